"""Stop strings on detokenized text: held back while undecided, cut before the match, caught across tokens."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from common.model_files import local_copy
from gateway.text_stream import TextStream
from gateway.tokenizer import Detokenizer

TEXT = "The quick brown fox jumps over the lazy dog. 東京 and café 🦙!"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(local_copy("smollm2").path)


def run(
    tokenizer, ids: list[int], stop: tuple[str, ...], min_tokens: int = 0
) -> tuple[list[str], int | None]:
    """Feeds the tokens one at a time like the engine; (released deltas, index of the stopping token)."""
    stream = TextStream(Detokenizer(tokenizer), stop)
    deltas = []
    for i, token in enumerate(ids):
        deltas.append(stream.append([token], match=i + 1 >= min_tokens))
        if stream.stopped:
            return deltas, i
    deltas.append(stream.finish())
    return deltas, None


def test_a_stop_string_split_across_tokens_ends_the_text_right_before_it(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert " brown" in pieces and " fox" in pieces
    deltas, stopped_at = run(tokenizer, ids, ("own fo",))
    assert "".join(deltas) == "The quick br"
    assert stopped_at == pieces.index(" fox"), "the token that completes the stop string ends the stream"
    assert deltas[pieces.index(" brown")] == " br", "'own' may start the stop string: held back"


def test_held_text_is_released_once_it_cannot_start_a_stop_string(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    deltas, stopped_at = run(tokenizer, ids, ("brown cat", "lazy cow"))
    assert stopped_at is None
    assert "".join(deltas) == TEXT
    brown = [tokenizer.decode([i]) for i in ids].index(" brown")
    assert deltas[brown] == " " and deltas[brown + 1] == "brown fox"


def test_the_earliest_of_several_stop_strings_wins_and_multibyte_text_matches(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert "".join(run(tokenizer, ids, ("dog", "lazy"))[0]) == "The quick brown fox jumps over the "
    assert "".join(run(tokenizer, ids, ("京 and",))[0]) == "The quick brown fox jumps over the lazy dog. 東"
    assert "".join(run(tokenizer, ids, ("🦙",))[0]) == TEXT[: TEXT.index("🦙")]


def test_before_min_tokens_stop_strings_do_not_match(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    quick = [tokenizer.decode([i]) for i in ids].index(" quick")
    deltas, stopped_at = run(tokenizer, ids, ("quick", "lazy"), min_tokens=quick + 2)
    assert "".join(deltas) == "The quick brown fox jumps over the "
    deltas, stopped_at = run(tokenizer, ids, ("quick",), min_tokens=quick + 2)
    assert stopped_at is None and "".join(deltas) == TEXT


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_stop_string_cuts_the_text_at_its_first_occurrence(tokenizer, data):
    text = data.draw(st.text(st.sampled_from("ab c.é東🦙\n"), min_size=1, max_size=30))
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    start = data.draw(st.integers(0, len(full) - 1))
    stop = data.draw(
        st.one_of(st.just(full[start : start + data.draw(st.integers(1, 4))]), st.text("xab", min_size=1))
    )
    deltas, stopped_at = run(tokenizer, ids, (stop,))
    if stop in full:
        assert "".join(deltas) == full[: full.index(stop)]
        # NOTE: a stop string is caught once its text is released, which can wait for a split character
        assert stopped_at is not None and stop in tokenizer.decode(ids[: stopped_at + 1])
    else:
        assert stopped_at is None and "".join(deltas) == full
