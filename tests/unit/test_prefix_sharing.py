"""Prefix cache, fork, copy-on-write and eviction in the block manager, over every allocator."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.allocators import registry
from cache_service.prefix_cache import block_hash, chain, root_hash
from cache_service.prefix_match import StepBlocks
from cache_service.sequence import SeqRequest, SeqState
from common.errors import InvalidArgument, PagedServeError, ResourceExhausted
from tests.blocks import allocate, extend
from tests.fake_pool import BS, manager

ALLOCATORS = [*registry.available(), "tests.toy_allocator:StackAllocator"]


def test_the_chain_walker_hashes_each_full_block_on_the_one_before():
    root, tokens = root_hash("model", ""), list(range(10))
    links = list(chain(root, tokens, BS, 0, 2))
    assert [index for index, _ in links] == [0, 1]
    assert links[0][1] == block_hash(root, tokens[:4])
    assert links[1][1] == block_hash(links[0][1], tokens[4:8])
    assert list(chain(links[0][1], tokens, BS, 1, 2)) == links[1:], "a walk resumes from any block"
    with pytest.raises(AssertionError):
        list(chain(root, tokens, BS, 0, 3))  # block 2 is not full


def test_step_blocks_match_what_an_earlier_prompt_computes_never_the_last_token():
    step, root = StepBlocks(BS), root_hash("model", "")
    first = SeqState(10, root, list(range(10)), block_table=[7, 8, 9])
    step.add(first, 10)
    first_hash = block_hash(root, [0, 1, 2, 3])
    second = SeqState(9, root, list(range(8)) + [99])
    assert step.match(second, 9) == [(7, first_hash), (8, block_hash(first_hash, [4, 5, 6, 7]))]
    assert [block_id for block_id, _ in step.match(SeqState(8, root, list(range(8))), 8)] == [7]


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_a_second_prompt_reuses_written_full_blocks_but_recomputes_the_last_token(allocator):
    blocks, pool = manager(allocator=allocator)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    (a,) = allocate(blocks, [SeqRequest("a", 10, prompt)])
    assert blocks.cached_tokens("a") == 0
    extend(blocks, [SeqRequest("a", 11, [7], num_computed=10)])  # a's prompt K/V is written now
    (b,) = allocate(blocks, [SeqRequest("b", 10, prompt)])
    assert blocks.cached_tokens("b") == 8 and b[:2] == a[:2] and b[2] != a[2]
    (c,) = allocate(blocks, [SeqRequest("c", 8, prompt[:8])])
    assert blocks.cached_tokens("c") == 7, "a full hit still recomputes the last token"
    assert c[0] == a[0] and c[1] != a[1], "the block the prefix ends in is copied, not shared"
    assert pool.copies == [(a[1], c[1])], "its K/V is copied before compute writes the rest"
    allocate(blocks, [SeqRequest("salted", 10, prompt, cache_salt="tenant")])
    assert blocks.cached_tokens("salted") == 0
    stats = blocks.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (38, 15)
    assert stats.copy_on_writes == 1
    blocks.check_invariants()
    blocks.free(["a", "b", "c", "salted"])
    stats = blocks.stats()
    assert (stats.used_blocks, stats.cached_blocks) == (0, 2)
    blocks.check_invariants()


def test_nothing_is_shared_with_the_prefix_cache_off():
    blocks, _ = manager(prefix_caching=False)
    allocate(blocks, [SeqRequest("a", 10, list(range(10)))])
    blocks.free(["a"], {"a": 10})
    allocate(blocks, [SeqRequest("b", 10, list(range(10)))])
    assert blocks.cached_tokens("b") == 0 and blocks.stats().cached_blocks == 0


def test_fork_shares_blocks_and_the_first_write_copies():
    blocks, pool = manager()
    tokens = list(range(6))
    (table,) = allocate(blocks, [SeqRequest("p", 6, tokens)])
    pool.write(table, tokens, 0)
    (child,) = blocks.fork("p", ["c"])
    assert child == table and [blocks.refcount(b) for b in table] == [2, 2]
    # c recomputes its last token, p writes a new one: both land in the shared second block
    (c,) = extend(blocks, [SeqRequest("c", 6, [], num_computed=5)])
    (p,) = extend(blocks, [SeqRequest("p", 7, [42], num_computed=6)])
    assert c[0] == p[0] and c[1] != p[1], "the first writer copied, the last one keeps the block"
    assert pool.copies == [(table[1], c[1])] and blocks.stats().copy_on_writes == 1
    assert pool.read(c, 5) == tokens[:5]
    blocks.check_invariants()
    with pytest.raises(InvalidArgument, match="child ids must be distinct"):
        blocks.fork("p", ["x", "x"])


def test_cached_blocks_are_evicted_least_recently_used():
    blocks, _ = manager(4)
    allocate(blocks, [SeqRequest("a", 8, list(range(8))), SeqRequest("b", 8, list(range(50, 58)))])
    blocks.free(["a"], {"a": 8})
    blocks.free(["b"], {"b": 8})
    assert blocks.stats().cached_blocks == 4 and blocks.stats().free_blocks == 0
    allocate(blocks, [SeqRequest("c", 8, list(range(90, 98)))])
    assert blocks.stats().evictions == 2
    allocate(blocks, [SeqRequest("b2", 8, list(range(50, 58)))])
    assert blocks.cached_tokens("b2") == 4, "b's blocks were used last, a's went first"
    with pytest.raises(ResourceExhausted, match="need 2 blocks, 0 free of 4"):
        allocate(blocks, [SeqRequest("d", 8)])
    blocks.check_invariants()


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_exhaustion_is_resource_exhausted_for_every_allocator(allocator):
    blocks, _ = manager(4, allocator)
    allocate(blocks, [SeqRequest("a", 12)])
    with pytest.raises(ResourceExhausted, match="need 2 blocks, 1 free of 4"):
        extend(blocks, [SeqRequest("a", 20)])
    with pytest.raises(ResourceExhausted):
        allocate(blocks, [SeqRequest("b", 8)])
    blocks.check_invariants()


# property: random allocate / extend / fork / free (eviction under pressure) keep every invariant

_op = st.tuples(
    st.sampled_from(["allocate", "step", "fork", "free"]),
    st.integers(0, 5),
    st.integers(0, 3),
    st.integers(1, 9),
)


@pytest.mark.parametrize("allocator", ALLOCATORS)
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_op, max_size=40), num_blocks=st.integers(2, 12))
def test_random_sharing_keeps_invariants_and_leaks_nothing(allocator, ops, num_blocks):
    blocks, pool = manager(num_blocks, allocator)
    seqs: dict[str, tuple[list[int], int, int]] = {}  # the model: seq id -> (tokens, computed, cache holds)
    for call, who, prompt, length in ops:
        seq_id, other = f"s{who}", f"s{(who + 1) % 6}"
        try:
            if call == "allocate" and seq_id not in seqs:
                tokens = [prompt] * 3 + list(range(length))  # prompts 0..3 share prefixes
                (table,) = allocate(blocks, [SeqRequest(seq_id, len(tokens), tokens)])
                cached = blocks.cached_tokens(seq_id)
                seqs[seq_id] = (tokens, cached, len(tokens))
                assert pool.read(table, cached) == tokens[:cached], "a prefix hit holds its tokens"
            elif call == "step" and seq_id in seqs:  # one engine step: compute writes the rest, samples one
                tokens, computed, known = seqs[seq_id]
                request = SeqRequest(seq_id, len(tokens), tokens[known:], num_computed=computed)
                (table,) = extend(blocks, [request])
                assert pool.read(table, computed) == tokens[:computed], "copy-on-write kept the K/V"
                pool.write(table, tokens, computed)
                seqs[seq_id] = (tokens + [length], len(tokens), len(tokens))
            elif call == "fork" and seq_id in seqs and other not in seqs:
                blocks.fork(seq_id, [other])
                seqs[other] = seqs[seq_id]
            elif call == "free" and seq_id in seqs:
                blocks.free([seq_id], {seq_id: seqs.pop(seq_id)[1]})
        except ResourceExhausted:
            pass
        except PagedServeError as exc:
            raise AssertionError(f"{call} {seq_id} refused: {exc!r}") from exc
        blocks.check_invariants()
        for block_id in range(num_blocks):  # an indexed block holds the tokens its hash names
            if blocks.block_pool.prefix.is_indexed(block_id):
                assert pool.read([block_id], BS) == list(blocks.block_pool.prefix.tokens(block_id))
        stats = blocks.stats()
        assert stats.free_blocks + stats.used_blocks + stats.cached_blocks == num_blocks
    blocks.free(list(seqs))
    blocks.check_invariants()
    assert blocks.stats().used_blocks == 0 and blocks.stats().num_sequences == 0
