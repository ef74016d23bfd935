"""A Forward request as sent, checked, and the batch compute derives from it: positions, context lengths and
slots equal their definitions; every malformed request is refused naming the field."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import InvalidArgument
from compute_service.batch import ForwardBatch
from compute_service.validation import Limits
from gateway.step_request import forward_request as gateway_request
from protos import compute_pb2
from tests.forward import forward_request, gateway_seq
from tests.forward import replace_field as _replace
from tests.forward import set_field as _set

LIMITS = Limits(vocab_size=100, max_model_len=64, num_blocks=40, block_size=4)


def naive(new: list[list[int]], cached: list[int], tables: list[list[int]], block_size: int) -> tuple:
    """Positions and slots of every new token, and context lengths, straight from the definitions."""
    positions = [
        p for tokens, start in zip(new, cached, strict=True) for p in range(start, start + len(tokens))
    ]
    slots = [
        table[p // block_size] * block_size + p % block_size
        for tokens, start, table in zip(new, cached, tables, strict=True)
        for p in range(start, start + len(tokens))
    ]
    return positions, slots, [start + len(tokens) for tokens, start in zip(new, cached, strict=True)]


@st.composite
def steps(draw) -> tuple:
    """A packed step: per sequence some cached and at least one new token, on distinct shuffled blocks."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_seqs = draw(st.integers(1, 5))
    cached = draw(st.lists(st.integers(0, 20), min_size=num_seqs, max_size=num_seqs))
    q_lens = draw(st.lists(st.integers(1, 12), min_size=num_seqs, max_size=num_seqs))
    spare = draw(st.lists(st.integers(0, 2), min_size=num_seqs, max_size=num_seqs))
    sizes = [-(-(c + q) // block_size) + s for c, q, s in zip(cached, q_lens, spare, strict=True)]
    blocks = draw(st.permutations(range(sum(sizes))))
    tables = [list(blocks[sum(sizes[:i]) : sum(sizes[: i + 1])]) for i in range(num_seqs)]
    new = [draw(st.lists(st.integers(0, 99), min_size=q, max_size=q)) for q in q_lens]
    return new, cached, tables, block_size


@settings(max_examples=100, deadline=None)
@given(steps())
def test_derived_positions_context_lens_and_slots_follow_their_definitions(step):
    new, cached, tables, block_size = step
    limits = Limits(vocab_size=100, max_model_len=64, num_blocks=sum(map(len, tables)), block_size=block_size)
    batch = ForwardBatch.from_request(forward_request(new, cached, tables, block_size=block_size), limits)
    positions, slots, context_lens = naive(new, cached, tables, block_size)
    assert batch.positions.tolist() == positions
    assert batch.slot_mapping.tolist() == slots
    assert batch.context_lens.tolist() == context_lens
    assert batch.token_ids.tolist() == [t for tokens in new for t in tokens]
    assert batch.block_tables.shape == (len(new), max(-(-n // block_size) for n in context_lens))


def small_request() -> compute_pb2.ForwardRequest:
    """Sequence 0: 6 new tokens on 2 cached ones, in blocks 20 and 21; sequence 1: a 3-token prompt in 22."""
    return forward_request([[1, 2, 3, 4, 5, 6], [7, 8, 9]], [2, 0], [[20, 21], [22]], block_size=4)


def _width(width: int):
    def mutate(request: compute_pb2.ForwardRequest) -> None:
        request.block_table_width = width

    return mutate


BAD_REQUESTS = {
    "no tokens": (_replace("token_ids", []), "token_ids is empty"),
    "cu_seqlens_q not ending at the tokens": (
        _replace("cu_seqlens_q", [0, 6, 8]),
        "cu_seqlens_q must run",
    ),
    "empty sequence": (_replace("cu_seqlens_q", [0, 9, 9]), "not increasing at sequence 1"),
    "num_computed count": (_replace("num_computed", [2, 0, 0]), "num_computed has 3 entries for 2"),
    "sample count": (_replace("sample", [True]), "sample has 1 entries for 2"),
    "table size": (_width(3), "block_tables has 4 entries, expected num_seqs (2) * block_table_width (3)"),
    "no table columns": (
        _replace("block_tables", []),
        "block_table_width (2) with block_table_width >= 1",
    ),
    "sampling count": (
        _replace("sample", [False, True]),
        "2 sampling entries for 1 sequences",
    ),
    "token outside the vocabulary": (
        _set("token_ids", 4, 100),
        "token_ids[4] = 100 is outside the vocabulary",
    ),
    "negative num_computed": (_set("num_computed", 1, -2), "num_computed[1] = -2 is negative"),
    "context beyond the model": (_set("num_computed", 1, 62), "sequence 1 reaches 65 tokens"),
    "table narrower than the context": (
        _set("num_computed", 1, 6),
        "sequence 1 needs 3 blocks for 9 tokens",
    ),
    "block missing": (_set("block_tables", 1, -1), "block_tables[0][1] = -1 is outside the pool"),
    "block outside the pool": (
        _set("block_tables", 2, 40),
        "block_tables[1][0] = 40 is outside the pool",
    ),
    "shared block written": (_set("block_tables", 2, 21), "slot 84 is written by two new tokens"),
    "cached_prefix count": (_replace("cached_prefix", [True]), "cached_prefix has 1 entries for 2 sequences"),
    "prompt_chunk count": (
        _replace("prompt_chunk", [True] * 3),
        "prompt_chunk has 3 entries for 2 sequences",
    ),
}


@pytest.mark.parametrize(("mutate", "message"), BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_malformed_requests_are_refused_naming_the_field(mutate, message):
    request = small_request()
    ForwardBatch.from_request(request, LIMITS)
    mutate(request)
    with pytest.raises(InvalidArgument) as err:
        ForwardBatch.from_request(request, LIMITS)
    assert message in str(err.value)


def test_blocks_past_the_context_are_not_checked():
    request = small_request()
    _replace("block_tables", [20, 21, -1, 22, -5, 99])(request)
    request.block_table_width = 3
    assert ForwardBatch.from_request(request, LIMITS).block_tables.tolist() == [[20, 21, -1], [22, -5, 99]]


def test_a_block_read_by_one_sequence_may_be_written_by_another():
    # sequence 1 attends over block 20, which sequence 0 writes in this step (prefix sharing within a step)
    request = forward_request([[1, 2, 3, 4], [5]], [0, 4], [[20], [20, 21]], block_size=4)
    assert ForwardBatch.from_request(request, LIMITS).slot_mapping.tolist() == [80, 81, 82, 83, 84]


def test_the_gateway_sends_each_chunk_and_compute_derives_its_positions_and_slots():
    seqs = [
        gateway_seq(
            list(range(1, 11)), 0, 6, LIMITS.vocab_size
        ),  # the first chunk of a prompt, not sampled yet
        gateway_seq(
            list(range(11, 18)), 4, 7, LIMITS.vocab_size
        ),  # the rest of a prompt after a prefix-cache hit
        gateway_seq(list(range(20, 29)), 8, 9, LIMITS.vocab_size),  # a decode
    ]
    tables = [[5, 9], [3, 0], [7, 8, 1]]
    request = gateway_request(seqs, [tables], "epoch", frozenset({2}))
    assert list(request.num_computed) == [0, 4, 8]
    assert list(request.sample) == [False, True, True] and len(request.sampling) == 2
    new = [seq.token_ids[seq.num_computed : seq.chunk_end] for seq in seqs]
    batch = ForwardBatch.from_request(request, LIMITS)
    positions, slots, context_lens = naive(new, [0, 4, 8], tables, LIMITS.block_size)
    assert batch.token_ids.tolist() == [t for tokens in new for t in tokens]
    assert batch.positions.tolist() == positions
    assert batch.slot_mapping.tolist() == slots
    assert batch.context_lens.tolist() == context_lens == [6, 7, 9]
    assert list(request.cached_prefix) == [] and batch.cached_prefix_rows == []
    seqs[1].cached_prefix = True
    request = gateway_request(seqs, [tables], "epoch", frozenset({2}))
    assert list(request.cached_prefix) == [False, True, False]
    assert ForwardBatch.from_request(request, LIMITS).cached_prefix_rows == [1]
    # every chunk lies in its prompt (the third is a prompt's last token); a generated token's does not
    assert list(request.prompt_chunk) == [True, True, True]
    seqs[2].output_ids.append(40)
    seqs[2].num_computed, seqs[2].chunk_end = 9, 10
    assert list(gateway_request(seqs, [tables], "epoch", frozenset({2})).prompt_chunk) == [True, True, False]
