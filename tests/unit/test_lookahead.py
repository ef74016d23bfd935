"""Lookahead: a running sequence's table holds blocks for tokens past num_tokens (multi-step decode)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.allocators import registry
from cache_service.block_manager import BlockManager
from cache_service.prefix_cache import root_hash
from cache_service.sequence import MAX_LOOKAHEAD_TOKENS, SeqRequest, SeqState
from common.errors import InvalidArgument, ResourceExhausted
from common.paging import blocks_for
from tests.blocks import allocate, extend

BLOCK_SIZE = 8


def manager(num_blocks: int = 16, block_size: int = BLOCK_SIZE) -> BlockManager:
    return BlockManager(registry.create("freelist", num_blocks), block_size)


def snapshot(blocks: BlockManager, seq_ids: list[str]) -> tuple:
    """Everything a refused call must leave as it was: tables, available blocks, the stats."""
    return {seq_id: blocks.block_table(seq_id) for seq_id in seq_ids}, blocks.num_available, blocks.stats()


def step(
    blocks: BlockManager, seq_id: str, num_tokens: int, num_computed: int, lookahead: int = 0
) -> list[int]:
    """A running sequence (not prefix-cached) reports its progress; returns the reply's tail."""
    (tail,) = blocks.reserve((), [SeqRequest(seq_id, num_tokens, (), num_computed, lookahead=lookahead)])
    blocks.check_invariants()
    return tail.block_ids


def indexed(blocks: BlockManager, seq_id: str) -> list[int]:
    """The table indexes of the sequence's blocks that are in the prefix index."""
    table = blocks.block_table(seq_id)
    return [index for index, block_id in enumerate(table) if blocks.block_pool.prefix.is_indexed(block_id)]


def test_lookahead_at_a_block_boundary_takes_the_next_block_and_later_steps_grow_into_it():
    blocks = manager(16)
    (first,) = allocate(blocks, [SeqRequest("a", 7)])
    assert blocks.num_available == 15
    # 8 tokens fill the first block exactly: lookahead 8 is the whole next block
    tail = step(blocks, "a", 8, 7, lookahead=8)
    table = blocks.block_table("a")
    assert len(table) == 2 and table[:1] == first and tail == table
    assert blocks.num_available == 14
    assert blocks.stats().stored_tokens == 8 and blocks.stats().table_slots == 2 * BLOCK_SIZE
    assert step(blocks, "a", 8, 8) == table[1:], "lookahead 0 keeps the block: a table never shrinks"
    for num_tokens in range(9, 17):
        assert step(blocks, "a", num_tokens, num_tokens - 1) == table[1:]
        assert blocks.num_available == 14, "growing into the lookahead block takes none"
    assert blocks.block_table("a") == table
    assert len(step(blocks, "a", 17, 16)) == 1 and blocks.num_available == 13, "past it: a third block"
    assert blocks.free(["a"]) == 3


def test_lookahead_when_blocks_are_short_is_refused_and_changes_nothing():
    blocks = manager(3)
    allocate(blocks, [SeqRequest("a", 7), SeqRequest("b", 8)])
    before = snapshot(blocks, ["a", "b"])
    too_far = SeqRequest("a", 8, (), 7, lookahead=16)
    assert not blocks.can_reserve((), [too_far])
    with pytest.raises(ResourceExhausted, match="need 2 blocks, 1 free of 3"):
        blocks.reserve((), [too_far, SeqRequest("b", 8, (), 8)])
    assert snapshot(blocks, ["a", "b"]) == before
    blocks.check_invariants()
    assert blocks.can_reserve((), [SeqRequest("a", 8, (), 7, lookahead=8)]), "one block fits"
    assert snapshot(blocks, ["a", "b"]) == before, "a predicate takes nothing"


@pytest.mark.parametrize(
    ("new", "running", "message"),
    [
        (
            [],
            [SeqRequest("a", 9, (), 8, lookahead=-1)],
            r"'a': lookahead_tokens must be in \[0, 64\], got -1",
        ),
        (
            [],
            [SeqRequest("a", 9, (), 8, lookahead=65)],
            r"'a': lookahead_tokens must be in \[0, 64\], got 65",
        ),
        (
            [SeqRequest("n", 4, lookahead=1)],
            [SeqRequest("a", 9, (), 8, lookahead=8)],
            r"'n': lookahead_tokens must be 0 for a new sequence \(running sequences take \[0, 64\]\), got 1",
        ),
        (
            [SeqRequest("n", 4)],
            [SeqRequest("a", 9, (), 8, lookahead=8), SeqRequest("b", 5, (), 4, lookahead=99)],
            r"'b': lookahead_tokens must be in \[0, 64\], got 99",
        ),
    ],
)
def test_an_invalid_lookahead_refuses_the_whole_batch_and_changes_nothing(new, running, message):
    blocks = manager(16)
    allocate(blocks, [SeqRequest("a", 8), SeqRequest("b", 4)])
    before = snapshot(blocks, ["a", "b"])
    with pytest.raises(InvalidArgument, match=message):
        blocks.reserve(new, running)
    with pytest.raises(InvalidArgument, match=message):
        blocks.can_reserve(new, running)
    assert snapshot(blocks, ["a", "b"]) == before
    assert blocks.stats().num_sequences == 2
    blocks.check_invariants()


def test_the_limit_is_allowed_and_free_returns_the_lookahead_blocks():
    blocks = manager(16)
    allocate(blocks, [SeqRequest("a", 8), SeqRequest("b", 3)])
    step(blocks, "a", 8, 8, lookahead=MAX_LOOKAHEAD_TOKENS)
    step(blocks, "b", 4, 3, lookahead=5)
    assert len(blocks.block_table("a")) == blocks_for(8 + MAX_LOOKAHEAD_TOKENS, BLOCK_SIZE) == 9
    assert len(blocks.block_table("b")) == 2
    assert blocks.num_available == 5
    assert blocks.free(["a", "b"]) == 11
    assert blocks.num_available == 16 and blocks.stats().free_blocks == 16
    assert (blocks.stats().stored_tokens, blocks.stats().table_slots) == (0, 0)
    blocks.check_invariants()


def run_prompt(lookahead: int) -> tuple[BlockManager, list[int]]:
    """A 16-token prompt (block size 4) decodes 4 tokens; a multi-step decode reserves them ahead."""
    blocks = manager(32, block_size=4)
    prompt = list(range(100, 116))
    allocate(blocks, [SeqRequest("a", 16, prompt)])
    blocks.reserve((), [SeqRequest("a", 17, [7], 16, lookahead=lookahead)])
    blocks.check_invariants()
    blocks.reserve((), [SeqRequest("a", 21, [8, 9, 10, 11], 20)])
    blocks.check_invariants()
    return blocks, prompt


@pytest.mark.parametrize("lookahead", [0, 3, 8])
def test_lookahead_blocks_enter_the_prefix_index_only_once_their_tokens_are_written(lookahead):
    blocks, prompt = run_prompt(lookahead)
    table = blocks.block_table("a")
    assert len(table) == max(6, blocks_for(17 + lookahead, 4))
    assert indexed(blocks, "a") == [0, 1, 2, 3, 4], "the five written full blocks, lookahead or not"
    query = SeqRequest("q", 22, [*prompt, 7, 8, 9, 10, 11, 12])
    assert blocks.prefix_blocks(query) == table[:5], "a second sequence hits the same blocks"
    (hit,) = blocks.reserve([query], ())
    assert hit.cached_tokens == 20 and hit.block_ids[:5] == table[:5]
    assert blocks.free(["a", "q"], {"a": 21, "q": 20}) == len(table) + 1
    assert blocks.stats().cached_blocks == 5, "the lookahead blocks are freed, not cached"
    blocks.check_invariants()


def test_a_lookahead_block_is_not_indexed_before_its_tokens_arrive():
    blocks = manager(32, block_size=4)
    allocate(blocks, [SeqRequest("a", 8, list(range(8)))])
    blocks.reserve((), [SeqRequest("a", 8, [], 8, lookahead=8)])
    assert len(blocks.block_table("a")) == 4 and indexed(blocks, "a") == [0, 1]
    blocks.index_written({"a": 16})
    assert indexed(blocks, "a") == [0, 1], "progress past the known tokens indexes nothing more"
    blocks.free(["a"], {"a": 8})
    assert blocks.stats().cached_blocks == 2 and blocks.stats().free_blocks == 30
    blocks.check_invariants()


def test_fork_shares_only_the_blocks_of_the_parents_tokens():
    blocks = manager(16, block_size=4)
    allocate(blocks, [SeqRequest("a", 8, list(range(8)))])
    blocks.reserve((), [SeqRequest("a", 9, [8], 8, lookahead=7)])
    parent = blocks.block_table("a")
    assert len(parent) == 4
    (child,) = blocks.fork("a", ["c"])
    assert child == parent[:3]
    assert [blocks.refcount(block_id) for block_id in parent] == [2, 2, 2, 1]
    assert blocks.stats().table_slots == 7 * 4
    blocks.check_invariants()
    # the child writes token 9 into the block it shares with a: copy-on-write, as without lookahead
    (tail,) = blocks.reserve((), [SeqRequest("c", 10, [9], 9)])
    assert tail.block_ids[0] not in parent and blocks.block_table("c")[:2] == parent[:2]
    (tail,) = blocks.reserve((), [SeqRequest("a", 10, [50], 9)])
    assert tail.block_ids == parent[2:], "the parent keeps its blocks, lookahead included"
    blocks.check_invariants()
    assert blocks.free(["a", "c"], {"a": 9, "c": 9}) == 2 + 3, "a's own two, then the three c held last"
    assert blocks.num_available == 16


def test_the_invariant_bounds_a_table_by_its_tokens_and_the_lookahead_limit():
    root = root_hash("", "")
    high = blocks_for(5 + MAX_LOOKAHEAD_TOKENS, BLOCK_SIZE)
    SeqState(5, root, None, list(range(high))).check_invariants("s", BLOCK_SIZE)
    with pytest.raises(AssertionError):
        SeqState(5, root, None, list(range(high + 1))).check_invariants("s", BLOCK_SIZE)
    with pytest.raises(AssertionError):
        SeqState(9, root, None, [0]).check_invariants("s", BLOCK_SIZE)


_steps = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(steps=_steps, num_blocks=st.integers(1, 12))
def test_random_lookahead_steps_grow_tables_monotonically_and_free_everything(steps, num_blocks):
    blocks = manager(num_blocks, block_size=4)
    allocate(blocks, [SeqRequest("a", 1)])
    for added, lookahead in steps:
        before = snapshot(blocks, ["a"])
        table, num_tokens = before[0]["a"], blocks.stats().stored_tokens
        want = max(len(table), blocks_for(num_tokens + added + lookahead, 4))
        try:
            (grown,) = extend(
                blocks, [SeqRequest("a", num_tokens + added, (), num_tokens, lookahead=lookahead)]
            )
        except ResourceExhausted:
            assert want - len(table) > before[1]
            assert snapshot(blocks, ["a"]) == before
        else:
            assert len(grown) == want and grown[: len(table)] == table
            assert blocks.num_available == before[1] - (want - len(table))
        blocks.check_invariants()
    held = len(blocks.block_table("a"))
    assert blocks.free(["a"]) == held and blocks.num_available == num_blocks


def test_a_free_with_the_appended_tokens_indexes_the_blocks_they_complete():
    blocks = manager(32, block_size=4)
    allocate(blocks, [SeqRequest("a", 8, list(range(8)))])
    blocks.reserve((), [SeqRequest("a", 8, [], 8, lookahead=8)])  # slots for 16 tokens
    table = blocks.block_table("a")
    # a multi-step decode wrote 7 more tokens; the Free brings them: blocks 2 (full) and 3 (not) hold them
    assert blocks.free(["a"], {"a": 15}, {"a": list(range(8, 15))}) == 4
    query = SeqRequest("q", 14, list(range(14)))
    assert blocks.prefix_blocks(query) == table[:3], "the block the appended tokens completed is a hit"
    blocks.check_invariants()


@pytest.mark.parametrize(
    "num_computed, appended, message",
    [
        ({"a": 8}, {"a": list(range(9))}, "beyond its table's 16 slots"),  # 8 + 9 > 16
        ({"a": 13}, {"a": [1, 2, 3, 4]}, "num_computed 13 is out of range"),
        ({}, {"b": [1]}, "not freed"),
    ],
)
def test_a_free_with_appended_tokens_beyond_the_table_is_refused_and_changes_nothing(
    num_computed, appended, message
):
    blocks = manager(32, block_size=4)
    allocate(blocks, [SeqRequest("a", 8, list(range(8))), SeqRequest("b", 4, list(range(4)))])
    blocks.reserve((), [SeqRequest("a", 8, [], 8, lookahead=8)])
    before = snapshot(blocks, ["a", "b"])
    with pytest.raises(InvalidArgument, match=message):
        blocks.free(["a"], num_computed, appended)
    assert snapshot(blocks, ["a", "b"]) == before
    blocks.check_invariants()
