"""The hybrid KV manager: a table per KV group over one pool, sliding tables releasing their window's past."""

import pytest

from cache_service.allocators import registry
from cache_service.block_manager import BlockManager
from cache_service.hybrid_blocks import HybridBlocks
from cache_service.kv_pool import pool_groups
from cache_service.sequence import SeqRequest
from common.errors import InvalidArgument, NotFound, ResourceExhausted
from common.kv_groups import group_layers
from protos import cache_pb2

BS = 4
WINDOW = 9  # a query at p reads keys p-8..p: at most three blocks of four, four when it straddles


def hybrid(windows: list[int], num_blocks: int = 64, prefix_caching: bool = False) -> HybridBlocks:
    groups = group_layers(windows)
    return HybridBlocks(registry.create("freelist", num_blocks), groups, BS, prefix_caching=prefix_caching)


def grow(blocks: HybridBlocks | BlockManager, seq_id: str, start: int, end: int, chunk: int) -> None:
    """Runs a sequence from `start` written tokens to `end`, `chunk` tokens a step."""
    for computed in range(start, end, chunk):
        blocks.reserve((), [SeqRequest(seq_id, min(end, computed + chunk), num_computed=computed)])
        blocks.check_invariants()


def test_one_full_group_is_todays_single_table():
    plain = BlockManager(registry.create("freelist", 64), BS)
    blocks = hybrid([0, 0, 0])
    for manager in (plain, blocks):
        manager.reserve([SeqRequest("a", 10, list(range(10)))], ())
        manager.reserve((), [SeqRequest("a", 30, list(range(10, 30)), num_computed=10)])
    assert blocks.block_tables("a") == [plain.block_table("a")]
    assert blocks.null_block == -1
    blocks.check_invariants()


def test_a_sliding_table_releases_the_blocks_out_of_its_window():
    blocks = hybrid([WINDOW] * 2)
    blocks.reserve([SeqRequest("a", 8)], ())
    grow(blocks, "a", 8, 40, 1)
    (table,) = blocks.block_tables("a")
    assert len(table) == 10
    # the last step wrote token 39, whose window is 31..39: blocks 7..9
    assert table[:7] == [blocks.null_block] * 7
    assert blocks.null_block not in table[7:]
    assert blocks.held_blocks() == [3]
    assert blocks.num_available == 64 - 1 - 3


def test_a_chunk_keeps_the_window_of_its_first_token():
    blocks = hybrid([WINDOW])
    blocks.reserve([SeqRequest("a", 24)], ())
    blocks.reserve((), [SeqRequest("a", 40, num_computed=24)])
    (table,) = blocks.block_tables("a")
    # token 24 reads 16..24: blocks 4.. stay, though the chunk's last token reads only 31..39
    assert table.count(blocks.null_block) == 4
    assert blocks.held_blocks() == [6]


def test_full_groups_keep_every_block_while_sliding_groups_release():
    blocks = hybrid([WINDOW, WINDOW, 0, WINDOW, WINDOW, 0])
    assert [group.layers for group in blocks.groups] == [(2, 5), (0, 1), (3, 4)]
    blocks.reserve([SeqRequest("a", 16)], ())
    grow(blocks, "a", 16, 64, 4)
    assert blocks.held_blocks() == [16, 3, 3]
    full, sliding, _ = blocks.block_tables("a")
    assert len(full) == len(sliding) == 16
    assert not set(full) & set(sliding) - {blocks.null_block}


def test_released_blocks_serve_the_next_reservation():
    blocks = hybrid([WINDOW], num_blocks=8)
    blocks.reserve([SeqRequest("a", 4)], ())
    grow(blocks, "a", 4, 60, 4)
    assert blocks.held_blocks() == [3]
    blocks.reserve([SeqRequest("b", 16)], ())
    with pytest.raises(ResourceExhausted):
        blocks.reserve([SeqRequest("c", 16)], ())
    blocks.check_invariants()


def test_groups_are_reserved_all_or_nothing():
    blocks = hybrid([0, WINDOW], num_blocks=9)
    blocks.reserve([SeqRequest("a", 12)], ())
    before = blocks.block_tables("a"), blocks.num_available
    with pytest.raises(ResourceExhausted):
        blocks.reserve([SeqRequest("b", 8)], [SeqRequest("a", 16, num_computed=12)])
    assert (blocks.block_tables("a"), blocks.num_available) == before
    with pytest.raises(NotFound):
        blocks.block_tables("b")
    blocks.check_invariants()


def test_fork_and_free_skip_released_entries():
    blocks = hybrid([0, WINDOW])
    blocks.reserve([SeqRequest("p", 8)], ())
    grow(blocks, "p", 8, 30, 2)
    child_tables = blocks.fork("p", ["c"])
    assert [tables[0] for tables in child_tables] == [t[: -(-30 // BS)] for t in blocks.block_tables("p")]
    blocks.check_invariants()
    grow(blocks, "c", 30, 38, 2)  # the child copies the shared tail block before writing it
    blocks.check_invariants()
    assert blocks.free(["p", "c"]) > 0
    assert blocks.held_blocks() == [0, 0]
    assert blocks.num_available == 64 - 1
    blocks.check_invariants()


def test_prefix_caching_over_several_groups_is_refused():
    with pytest.raises(InvalidArgument, match="--no-prefix-cache"):
        hybrid([0, WINDOW], prefix_caching=True)


def test_one_sliding_group_keeps_prefix_caching():
    blocks = hybrid([WINDOW], prefix_caching=True)
    tokens = list(range(40))
    blocks.reserve([SeqRequest("a", 40, tokens)], ())
    blocks.reserve((), [SeqRequest("a", 41, [40], num_computed=40)])
    blocks.free(["a"], {"a": 41})
    blocks.reserve([SeqRequest("b", 40, tokens)], ())
    # nine whole blocks and three tokens of the tenth hit; blocks 0..6 lie before token 39's window
    assert blocks.managers[0].cached_tokens("b") == 39
    (table,) = blocks.block_tables("b")
    assert table[:7] == [blocks.null_block] * 7
    assert blocks.held_blocks() == [3]
    blocks.check_invariants()


def test_a_sliding_block_manager_alone_holds_its_null_block():
    blocks = BlockManager(registry.create("freelist", 16), BS, group=group_layers([WINDOW])[0])
    assert blocks.num_available == 15
    blocks.reserve([SeqRequest("a", 4)], ())
    grow(blocks, "a", 4, 40, 4)
    assert blocks.block_table("a")[:7] == [blocks.null_block] * 7
    blocks.free(["a"])
    assert blocks.num_available == 15
    blocks.check_invariants()


def pool_request(windows: list[int], num_layers: int = 2) -> cache_pb2.CreatePoolRequest:
    geometry = cache_pb2.PoolGeometry(num_layers=num_layers, num_kv_heads=1, head_dim=4)
    return cache_pb2.CreatePoolRequest(geometry=geometry, block_size=BS, sliding_windows=windows)


@pytest.mark.parametrize(
    ("windows", "prefix_caching", "groups"),
    [
        ([], True, [((0, 1), 0)]),
        ([0, 0], False, [((0, 1), 0)]),
        ([WINDOW, WINDOW], True, [((0, 1), WINDOW)]),
        ([0, WINDOW], False, [((0,), 0), ((1,), WINDOW)]),
        ([0, WINDOW], True, [((0, 1), 0)]),
    ],
)
def test_a_pools_groups_follow_the_windows_and_prefix_caching_keeps_one(windows, prefix_caching, groups):
    found = pool_groups(pool_request(windows), prefix_caching)
    assert [(group.layers, group.window) for group in found] == groups


@pytest.mark.parametrize("windows", [[WINDOW], [0, -1]])
def test_bad_sliding_windows_are_refused(windows):
    with pytest.raises(InvalidArgument):
        pool_groups(pool_request(windows), False)


def test_the_service_facing_calls_span_every_group():
    blocks = hybrid([0, WINDOW])
    blocks.reserve([SeqRequest("a", 4)], ())
    grow(blocks, "a", 4, 40, 4)
    stats = blocks.stats()
    # one count of sequences and tokens; every group's table slots (full: 10 blocks, sliding: 3 of them)
    assert (stats.num_sequences, stats.stored_tokens, stats.table_slots) == (1, 40, (10 + 3) * BS)
    assert stats.used_blocks == 10 + 3 + 1, "and the null block"
    full, sliding = blocks.block_tables("a")
    assert blocks.refcount(full[0]) == 1 and blocks.refcount(sliding[-1]) == 1
    assert blocks.prefix_blocks(SeqRequest("b", 8, list(range(8)))) == [], "no prefix caching"
    with pytest.raises(InvalidArgument):
        blocks.check([], [SeqRequest("a", 30, num_computed=40)])
    with pytest.raises(NotFound):
        blocks.index_written({"nobody": 4})
    blocks.free(["a"])
    assert blocks.stats().used_blocks == 1
    blocks.check_invariants()
