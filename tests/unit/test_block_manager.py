"""Block manager and allocators: lifecycle, all-or-nothing batches, typed errors, invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.allocators import registry
from cache_service.block_manager import BlockManager
from cache_service.sequence import SeqRequest
from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PagedServeError,
    ResourceExhausted,
)
from tests.blocks import allocate, extend

BLOCK_SIZE = 4
STEPS = {"allocate": allocate, "extend": extend}


def manager(num_blocks: int = 16, allocator: str = "freelist") -> BlockManager:
    return BlockManager(registry.create(allocator, num_blocks), BLOCK_SIZE)


def tables(blocks: BlockManager, seq_ids: list[str]) -> dict[str, list[int]]:
    return {seq_id: blocks.block_table(seq_id) for seq_id in seq_ids}


@pytest.mark.parametrize(("num_tokens", "blocks"), [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (100, 25)])
def test_blocks_needed_is_the_ceiling(num_tokens, blocks):
    assert manager().blocks_needed(num_tokens) == blocks


def test_allocate_extend_free_lifecycle():
    blocks = manager(16)
    a, b = allocate(blocks, [SeqRequest("a", 5), SeqRequest("b", 4)])
    assert (len(a), len(b)) == (2, 1)
    assert len(set(a + b)) == 3
    assert blocks.stats().free_blocks == 13
    assert [blocks.refcount(block_id) for block_id in a + b] == [1, 1, 1]
    blocks.check_invariants()

    (a_same,) = extend(blocks, [SeqRequest("a", 8)])
    assert a_same == a
    b_grown, a_grown = extend(blocks, [SeqRequest("b", 9), SeqRequest("a", 9)])
    assert b_grown[:1] == b and len(b_grown) == 3
    assert a_grown[:2] == a and len(a_grown) == 3
    assert blocks.block_table("a") == a_grown
    stats = blocks.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.num_sequences) == (6, 10, 2)
    assert stats.usage == pytest.approx(6 / 16)
    blocks.check_invariants()

    assert blocks.free(["a"]) == 3
    assert [blocks.refcount(block_id) for block_id in a_grown] == [0, 0, 0]
    with pytest.raises(NotFound):
        blocks.block_table("a")
    blocks.check_invariants()
    assert blocks.free(["b"]) == 3
    stats = blocks.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.num_sequences) == (0, 16, 0)
    blocks.check_invariants()


def test_stored_tokens_and_table_slots_follow_every_table_change():
    blocks = manager(16)

    def occupancy() -> tuple[int, int]:
        stats = blocks.stats()
        return stats.stored_tokens, stats.table_slots

    assert occupancy() == (0, 0)
    allocate(blocks, [SeqRequest("a", 5), SeqRequest("b", 4)])
    assert occupancy() == (9, 3 * BLOCK_SIZE)
    extend(blocks, [SeqRequest("a", 6), SeqRequest("b", 5)])
    assert occupancy() == (11, 4 * BLOCK_SIZE)
    blocks.fork("a", ["a/1"])
    assert occupancy() == (17, 6 * BLOCK_SIZE), "a shared block counts once per table holding it"
    with pytest.raises(ResourceExhausted):
        extend(blocks, [SeqRequest("a", 64)])
    assert occupancy() == (17, 6 * BLOCK_SIZE), "a refused call changes nothing"
    blocks.free(["a", "b"])
    assert occupancy() == (6, 2 * BLOCK_SIZE)
    blocks.check_invariants()
    blocks.free(["a/1"])
    assert occupancy() == (0, 0)


def test_exhaustion_refuses_the_whole_batch_with_the_numbers():
    blocks = manager(8)
    allocate(blocks, [SeqRequest("a", 12), SeqRequest("b", 4)])
    before = tables(blocks, ["a", "b"])

    assert not blocks.can_reserve([SeqRequest("c", 4), SeqRequest("d", 100)], ())
    with pytest.raises(ResourceExhausted, match=r"need 26 blocks, 4 free of 8"):
        allocate(blocks, [SeqRequest("c", 4), SeqRequest("d", 100)])
    with pytest.raises(NotFound):
        blocks.block_table("c")

    # each request fits alone, the batch does not
    assert blocks.can_reserve((), [SeqRequest("a", 20)])
    assert not blocks.can_reserve((), [SeqRequest("a", 20), SeqRequest("b", 16)])
    with pytest.raises(ResourceExhausted, match=r"need 5 blocks, 4 free of 8"):
        extend(blocks, [SeqRequest("a", 20), SeqRequest("b", 16)])

    assert tables(blocks, ["a", "b"]) == before
    assert blocks.stats().free_blocks == 4
    blocks.check_invariants()
    assert blocks.can_reserve([SeqRequest("c", 16)], ())
    assert blocks.stats().free_blocks == 4, "a predicate must not allocate"


def test_reserve_allocates_and_extends_in_one_all_or_nothing_call():
    blocks = manager(8)
    allocate(blocks, [SeqRequest("a", 4, list(range(4)))])
    # a wrote its 4 tokens and grows to 6; b arrives with a prompt whose first chunk is 5 of its tokens
    tails = blocks.reserve([SeqRequest("b", 5, list(range(10, 15)))], [SeqRequest("a", 6, [4, 5], 4)])
    # b's whole table, then a's from its second block (a's first block holds its 4 written tokens)
    assert [tail.first for tail in tails] == [0, 1]
    assert tails[0].block_ids == blocks.block_table("b") and len(tails[0].block_ids) == 2
    assert tails[1].block_ids == blocks.block_table("a")[1:] and len(blocks.block_table("a")) == 2
    assert blocks.stats().used_blocks == 4 and blocks.stats().free_blocks == 4
    blocks.check_invariants()

    before, free = tables(blocks, ["a", "b"]), blocks.stats().free_blocks
    with pytest.raises(ResourceExhausted, match=r"need 5 blocks, 4 free of 8"):
        blocks.reserve([SeqRequest("c", 12)], [SeqRequest("a", 16, list(range(6, 16)), 6)])
    with pytest.raises(NotFound, match="'c'"):
        blocks.reserve([SeqRequest("d", 4)], [SeqRequest("c", 4)])
    with pytest.raises(AlreadyExists, match="'b' already has a block table"):
        blocks.reserve([SeqRequest("b", 4)], [SeqRequest("a", 6, [], 6)])
    assert tables(blocks, ["a", "b"]) == before and blocks.stats().free_blocks == free
    assert blocks.stats().num_sequences == 2
    blocks.check_invariants()


def test_a_prompt_admitted_a_step_after_another_finds_the_blocks_that_step_wrote():
    blocks = manager(16)
    prompt = list(range(12))
    allocate(blocks, [SeqRequest("a", 12, prompt)])
    # the step after a's prefill reports its 12 written tokens and admits b, which starts with a's prompt
    b, _ = blocks.reserve([SeqRequest("b", 14, [*prompt, 50, 51])], [SeqRequest("a", 13, [99], 12)])
    assert blocks.cached_tokens("b") == 12
    assert b.block_ids[:3] == blocks.block_table("a")[:3] and len(b.block_ids) == 4
    blocks.check_invariants()


def test_prompts_admitted_together_share_the_blocks_the_first_computes_in_that_step():
    blocks = manager(16)
    system = list(range(100, 112))  # three blocks
    a, b, c = (SeqRequest(name, 14, [*system, n, n + 1]) for name, n in (("a", 1), ("b", 3), ("c", 5)))
    allocate(blocks, [a, b, c])
    shared = blocks.block_table("a")[:3]
    assert blocks.block_table("b")[:3] == blocks.block_table("c")[:3] == shared
    assert [blocks.cached_tokens(s) for s in "abc"] == [0, 12, 12]
    assert blocks.stats().used_blocks == 6 and blocks.stats().prefix_hit_tokens == 24
    # nothing is indexed before a reports its blocks written: a failed step leaves no unwritten block behind
    blocks.check_invariants()
    assert blocks.free(["a", "b", "c"]) == 6
    assert blocks.stats().cached_blocks == 0 and blocks.stats().free_blocks == 16

    allocate(blocks, [a, b])
    extend(blocks, [SeqRequest("a", 15, [7], 14), SeqRequest("b", 15, [8], 14)])
    blocks.check_invariants()
    allocate(blocks, [c])
    assert blocks.cached_tokens("c") == 12 and blocks.block_table("c")[:3] == blocks.block_table("a")[:3]


def test_reserve_returns_the_part_of_a_table_a_step_can_change():
    blocks = manager(8)
    allocate(blocks, [SeqRequest("a", 8, list(range(8)))])
    a = blocks.block_table("a")
    # tokens 0-7 are written (two full blocks, which stay); token 8 needs a third block, index 2
    (grown,) = blocks.reserve([], [SeqRequest("a", 9, [8], 8)])
    assert grown.first == 2 and len(grown.block_ids) == 1
    assert a + grown.block_ids == blocks.block_table("a")
    (same,) = blocks.reserve([], [SeqRequest("a", 10, [9], 9)])
    assert (same.first, same.block_ids) == (2, grown.block_ids)
    # a fork shares a's blocks: the child's next step copies the one it writes, and its tail says so
    (child,) = blocks.fork("a", ["b"])
    (copied,) = blocks.reserve([], [SeqRequest("b", 11, [10], 10)])
    assert copied.first == 2 and copied.block_ids != child[2:]
    assert child[:2] + copied.block_ids == blocks.block_table("b")
    blocks.check_invariants()


@pytest.mark.parametrize(
    ("call", "args", "error", "message"),
    [
        ("allocate", [("new", 4), ("a", 4)], AlreadyExists, "'a' already has a block table"),
        ("allocate", [("new", 4), ("new", 4)], AlreadyExists, "'new' is listed twice"),
        ("allocate", [("new", 4), ("other", 0)], InvalidArgument, "num_tokens must be > 0, got 0"),
        ("allocate", [("new", -3)], InvalidArgument, "num_tokens must be > 0, got -3"),
        ("allocate", [("", 4)], InvalidArgument, "seq_id must not be empty"),
        ("extend", [("a", 12), ("ghost", 4)], NotFound, "'ghost'"),
        ("extend", [("a", 5)], InvalidArgument, "holds 8 tokens: Reserve cannot shrink it to 5"),
        ("extend", [("a", 12), ("a", 16)], InvalidArgument, "listed twice"),
        ("extend", [("a", 0)], InvalidArgument, "num_tokens must be > 0"),
        ("free", ["a", "ghost"], NotFound, "'ghost'"),
        ("free", ["a", "a"], InvalidArgument, "listed twice"),
    ],
)
def test_an_invalid_batch_changes_nothing(call, args, error, message):
    blocks = manager(16)
    allocate(blocks, [SeqRequest("a", 8), SeqRequest("b", 4)])
    before, free_before = tables(blocks, ["a", "b"]), blocks.stats().free_blocks
    batch = args if call == "free" else [SeqRequest(*arg) for arg in args]

    with pytest.raises(error, match=message):
        {"allocate": allocate, "extend": extend, "free": BlockManager.free}[call](blocks, batch)

    assert tables(blocks, ["a", "b"]) == before
    assert blocks.stats().free_blocks == free_before
    assert blocks.stats().num_sequences == 2
    blocks.check_invariants()


def test_refcount_of_a_block_out_of_range_is_refused():
    blocks = manager(4)
    with pytest.raises(InvalidArgument, match="the pool has 4 blocks"):
        blocks.refcount(4)
    with pytest.raises(InvalidArgument):
        blocks.refcount(-1)


def test_check_invariants_catches_a_corrupted_refcount():
    blocks = manager(4)
    (table,) = allocate(blocks, [SeqRequest("a", 4)])
    blocks.block_pool.refcounts[table[0]] = 2
    with pytest.raises(AssertionError, match="refcounts differ"):
        blocks.check_invariants()


# allocators: every registered one must pass these


@pytest.fixture(params=[*registry.available(), "tests.toy_allocator:StackAllocator"])
def allocator(request):
    return registry.create(request.param, 8)


def test_allocator_hands_out_distinct_blocks_and_takes_them_back(allocator):
    first = allocator.allocate(3)
    second = allocator.allocate(5, hint=first)
    assert sorted(first + second) == list(range(8))
    assert allocator.num_free == 0 and allocator.num_total == 8
    assert not any(allocator.is_free(block_id) for block_id in first + second)
    allocator.free(second)
    assert allocator.num_free == 5
    assert all(allocator.is_free(block_id) for block_id in second)
    assert sorted(allocator.allocate(5)) == sorted(second)


def test_allocator_asserts_when_asked_for_more_than_is_free(allocator):
    allocator.allocate(6)
    with pytest.raises(AssertionError):
        allocator.allocate(3)


@pytest.mark.parametrize(
    ("to_free", "error", "message"),
    [
        (lambda held: [held[0], 3], FailedPrecondition, "block 3 is already free"),
        (lambda held: [held[0], held[0]], FailedPrecondition, "already free"),
        (lambda held: [held[1], 8], InvalidArgument, "block 8 does not exist"),
        (lambda held: [-1], InvalidArgument, "block -1 does not exist"),
    ],
)
def test_allocator_refuses_double_free_and_unknown_ids_changing_nothing(allocator, to_free, error, message):
    held = allocator.allocate(3)
    with pytest.raises(error, match=message):
        allocator.free(to_free(held))
    assert allocator.num_free == 5
    assert not any(allocator.is_free(block_id) for block_id in held)


def test_registry_refuses_an_unknown_allocator():
    with pytest.raises(
        InvalidArgument, match="unknown allocator .buddy.; choose one of bitmap, contiguous, freelist"
    ):
        registry.create("buddy", 8)


# property: random batches keep the invariants; refusals change nothing

_batch = st.lists(st.tuples(st.integers(0, 5), st.integers(-1, 40)), max_size=4)
_ops = st.lists(st.tuples(st.sampled_from(["allocate", "extend", "free"]), _batch), max_size=30)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, num_blocks=st.integers(1, 16))
def test_random_batches_keep_invariants_and_free_everything(ops, num_blocks):
    blocks = manager(num_blocks)
    held: dict[str, int] = {}  # the model: seq id -> tokens it holds
    for call, items in ops:
        batch = [SeqRequest(f"s{index}", num_tokens) for index, num_tokens in items]
        ids = [request.seq_id for request in batch]
        before, free_before = tables(blocks, list(held)), blocks.stats().free_blocks
        distinct = len(set(ids)) == len(ids)
        if call == "allocate":
            valid = distinct and all(r.seq_id not in held and r.num_tokens > 0 for r in batch)
            need = sum(blocks.blocks_needed(r.num_tokens) for r in batch) if valid else 0
        elif call == "extend":
            valid = distinct and all(r.seq_id in held and held[r.seq_id] <= r.num_tokens for r in batch)
            need = (
                sum(blocks.blocks_needed(r.num_tokens) - len(before[r.seq_id]) for r in batch) if valid else 0
            )
        else:
            valid, need = distinct and all(seq_id in held for seq_id in ids), 0

        try:
            result = blocks.free(ids) if call == "free" else STEPS[call](blocks, batch)
        except PagedServeError as exc:
            assert isinstance(exc, ResourceExhausted) == valid, f"{call} {batch} refused: {exc!r}"
            assert not valid or need > free_before, f"{call} {batch} refused: {exc}"
            assert tables(blocks, list(held)) == before
            assert blocks.stats().free_blocks == free_before
        else:
            assert valid and need <= free_before, f"{call} {batch} accepted"
            if call == "free":
                assert result == sum(len(before[seq_id]) for seq_id in ids)
                for seq_id in ids:
                    del held[seq_id]
            else:
                for request, table in zip(batch, result, strict=True):
                    assert table == blocks.block_table(request.seq_id)
                    assert len(table) == blocks.blocks_needed(request.num_tokens)
                    assert table[: len(before.get(request.seq_id, []))] == before.get(request.seq_id, [])
                    held[request.seq_id] = request.num_tokens
            assert blocks.stats().free_blocks == free_before - need + (result if call == "free" else 0)
        assert blocks.stats().num_sequences == len(held)
        blocks.check_invariants()

    blocks.free(list(held))
    blocks.check_invariants()
    assert blocks.stats().free_blocks == num_blocks
    assert blocks.stats().num_sequences == 0


def test_max_compute_trims_a_new_table_to_its_prefix_hits_plus_the_tokens_it_may_compute():
    blocks = manager(16)
    prompt = list(range(200, 230))  # 7 blocks of 4, the last one partly filled
    allocate(blocks, [SeqRequest("a", 30, prompt)])
    blocks.free(["a"], {"a": 30})
    assert blocks.cached_prefix(SeqRequest("q", 30, prompt)) == 28, "whole blocks, never the last token"
    assert blocks.cached_prefix(SeqRequest("q", 10, prompt[:10])) == 8
    (tail,) = blocks.reserve([SeqRequest("b", 30, prompt, max_compute=1)], [])
    assert (tail.cached_tokens, tail.num_tokens, len(tail.block_ids)) == (28, 29, 8)
    other = [1, 2, 3, *prompt[3:]]  # no hit: the table holds max_compute tokens
    (tail,) = blocks.reserve([SeqRequest("c", 30, other, max_compute=5)], [])
    assert (tail.cached_tokens, tail.num_tokens, len(tail.block_ids)) == (0, 5, 2)
    (tail,) = blocks.reserve([SeqRequest("d", 30, prompt)], [])
    assert tail.num_tokens == 30, "max_compute 0: num_tokens as asked"
    blocks.check_invariants()
    with pytest.raises(InvalidArgument, match="max_compute_tokens must be >= 0"):
        blocks.reserve([SeqRequest("e", 30, prompt, max_compute=-1)], [])


def test_a_lookup_finds_the_blocks_of_a_prefix_and_the_progress_of_running_ones_first():
    blocks = manager(16)
    prompt = list(range(300, 330))  # 8 blocks of 4
    allocate(blocks, [SeqRequest("a", 30, prompt)])
    query = SeqRequest("q", 30, prompt)
    assert blocks.prefix_blocks(query) == [], "nothing is written yet"
    blocks.index_written({"a": 13})
    assert blocks.prefix_blocks(query) == blocks.block_table("a")[:3], "the 3 full written blocks"
    assert blocks.cached_prefix(query) == 12
    blocks.index_written({"a": 13})
    assert blocks.prefix_blocks(query) == blocks.block_table("a")[:3], "indexing again changes nothing"
    with pytest.raises(NotFound):
        blocks.index_written({"nobody": 4})
    with pytest.raises(InvalidArgument, match="must not be negative"):
        blocks.index_written({"a": -1})
    tail, _ = blocks.reserve([SeqRequest("b", 30, prompt)], [SeqRequest("a", 30, (), num_computed=13)])
    assert tail.block_ids[:3] == blocks.block_table("a")[:3] and tail.cached_tokens == 12
    assert [blocks.refcount(b) for b in tail.block_ids[:3]] == [2, 2, 2], "a hit on held blocks takes none"
    blocks.check_invariants()


def test_a_block_written_again_stands_for_its_evictable_twin():
    blocks = manager()
    prompt = list(range(8))
    blocks.reserve([SeqRequest("a", 8, prompt)], ())
    twin = blocks.block_table("a")[1]
    blocks.free(["a"], {"a": 8})
    # b shares block 0 and copies 3 tokens of block 1 (the last token's block is computed), then writes it
    blocks.reserve([SeqRequest("b", 8, prompt)], ())
    copy = blocks.block_table("b")[1]
    assert copy != twin and blocks.cached_tokens("b") == 7
    blocks.reserve((), [SeqRequest("b", 9, [8], num_computed=8)])
    prefix = blocks.block_pool.prefix
    assert not prefix.is_indexed(twin) and blocks.allocator.is_free(twin) and prefix.is_indexed(copy)
    assert prefix.num_evictions == 0, "the twin's K/V lives on: not an eviction"
    blocks.check_invariants()
    first = blocks.block_table("b")[0]
    blocks.free(["b"], {"b": 9})
    assert blocks.prefix_blocks(SeqRequest("c", 9, [*prompt, 99])) == [first, copy]
