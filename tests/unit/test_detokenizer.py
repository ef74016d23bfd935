import pytest
from transformers import AutoTokenizer

from common.model_files import local_copy
from gateway.tokenizer import Detokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(local_copy("smollm2").path)


@pytest.mark.parametrize(
    "text",
    [
        "Plain English, with punctuation; and   spaces.",
        "Multi-byte: naïve café, 東京タワー, emoji 🦙🚀 and 👩‍👩‍👧 family.",
        "Code:\n\tdef f(x):\n\t\treturn x ** 2  # squared\n",
    ],
)
def test_deltas_concatenate_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False) + [2]
    detok = Detokenizer(tokenizer)
    deltas = [detok.step([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas), "a split character is held back until it is whole"


def test_a_character_split_across_tokens_comes_out_whole(tokenizer):
    ids = tokenizer.encode("🦙", add_special_tokens=False)
    assert len(ids) > 1, "this emoji is byte-level split by the tokenizer"
    detok = Detokenizer(tokenizer)
    assert [detok.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step([ids[-1]]) == "🦙"
