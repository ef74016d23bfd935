"""Incremental detokenization with the real SmolLM2 tokenizer: deltas concatenate to the full decode."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


# ids 17..251: the byte-level alphabet, each a single byte (lone UTF-8 lead and continuation bytes too)
BYTE_TOKENS = list(range(17, 252))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(st.integers(0, 49151), st.sampled_from(BYTE_TOKENS), st.sampled_from([0, 1, 2])),
        max_size=24,
    )
)
def test_random_token_sequences_detokenize_to_the_full_decode(tokenizer, ids):
    detok = Detokenizer(tokenizer)
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(codec="utf-8"), max_size=40))
def test_any_text_round_trips_token_by_token(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    deltas = [detok.step([i]) for i in ids] + [detok.flush()]
    full = tokenizer.decode(ids)
    assert "".join(deltas) == full
    # NOTE: the vocabulary lacks a few bytes (U+40000 encodes to three tokens): compare with the decode
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas), "a character split across tokens comes out whole"
