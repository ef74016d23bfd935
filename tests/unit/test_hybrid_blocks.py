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


def run(blocks: HybridBlocks, seq_id: str, tokens: list[int], chunk: int) -> None:
    """Prefills `tokens` in chunks of `chunk` and frees the sequence with every token written."""
    blocks.reserve([SeqRequest(seq_id, min(chunk, len(tokens)), tokens[:chunk])], ())
    for computed in range(chunk, len(tokens), chunk):
        end = min(len(tokens), computed + chunk)
        blocks.reserve((), [SeqRequest(seq_id, end, tokens[computed:end], num_computed=computed)])
        blocks.check_invariants()
    blocks.free([seq_id], {seq_id: len(tokens)})
    blocks.check_invariants()


def test_a_prefix_hit_holds_in_every_group():
    blocks = hybrid([0, WINDOW], prefix_caching=True)
    tokens = list(range(40))
    run(blocks, "a", tokens, 8)
    blocks.reserve([SeqRequest("b", 41, [*tokens, 99])], ())
    # ten whole blocks hit (the eleventh holds the last prompt token); token 40's window reads blocks 8, 9
    assert [manager.cached_tokens("b") for manager in blocks.managers] == [40, 40]
    full, sliding = blocks.block_tables("b")
    assert full[:10] == blocks.prefix_blocks(SeqRequest("c", 41, [*tokens, 98]))
    assert sliding[:8] == [blocks.null_block] * 8 and blocks.null_block not in sliding[8:]
    assert blocks.held_blocks() == [11, 3]
    assert blocks.stats().prefix_hit_tokens == 40
    blocks.check_invariants()


def evict(blocks: HybridBlocks, victims: list[int]) -> None:
    """Evicts exactly `victims` from the index (every other cached block made more recently used first)."""
    prefix = blocks.block_pool.prefix
    for block_id in range(blocks.block_pool.num_total):
        if prefix.is_evictable(block_id) and block_id not in victims:
            prefix.revive(block_id)
            prefix.park(block_id)
    blocks.allocator.free(prefix.evict(len(victims)))


def sliding_evicted(victims: list[int]) -> tuple[HybridBlocks, SeqRequest]:
    """A full and a sliding group after a 40-token prompt ran in chunks of 4 and ended, then the sliding
    group's blocks of these indices evicted; and a request for the same prompt and one token more."""
    blocks = hybrid([0, WINDOW], prefix_caching=True)
    tokens = list(range(40))
    run(blocks, "a", tokens, 4)
    request = SeqRequest("b", 41, [*tokens, 99])
    full, sliding = (manager.hit_candidates(request) for manager in blocks.managers)
    assert len(full) == 10 and None not in [block_id for block_id, _ in full + sliding]
    evict(blocks, [sliding[index][0] for index in victims])
    assert [manager.hit_candidates(request) for manager in blocks.managers][0] == full
    return blocks, request


def test_blocks_evicted_before_the_window_do_not_cut_the_hit():
    # token 40's window reads blocks 8 and 9
    blocks, request = sliding_evicted(list(range(8)))
    blocks.reserve([request], ())
    assert [manager.cached_tokens("b") for manager in blocks.managers] == [40, 40]
    assert blocks.block_tables("b")[1][:8] == [blocks.null_block] * 8
    assert blocks.stats().prefix_hit_tokens == 40
    blocks.check_invariants()


def test_a_hit_is_cut_to_the_prefix_every_group_holds():
    # without sliding block 9 the longest hit is 9 blocks: token 36's window reads blocks 7 and 8
    blocks, request = sliding_evicted([9])
    assert len(blocks.managers[0].prefix_blocks(request)) == 10, "the full group alone hits 10 blocks"
    assert len(blocks.prefix_blocks(request)) == 9
    blocks.reserve([request], ())
    assert [manager.cached_tokens("b") for manager in blocks.managers] == [36, 36]
    full, sliding = blocks.block_tables("b")
    assert sliding[:7] == [blocks.null_block] * 7 and blocks.null_block not in sliding[7:]
    assert full[:9] == blocks.managers[0].prefix_blocks(request)[:9]
    blocks.check_invariants()


def test_no_hit_holds_without_the_window_of_its_first_token():
    # a hit of k blocks reads block k - 1 and the one before it (block 0 alone for k = 1)
    blocks, request = sliding_evicted([0, 2, 4, 6, 8])
    assert blocks.prefix_blocks(request) == []
    blocks.reserve([request], ())
    assert [manager.cached_tokens("b") for manager in blocks.managers] == [0, 0]
    blocks.check_invariants()


def test_a_freed_prompt_is_evicted_tail_first_in_every_group_alike():
    # the sliding group released blocks 0-5 while the prompt ran; at its end they rank by their position
    # beside the full group's, so evicting six blocks takes both groups' last three, not the window's past
    blocks = hybrid([0, WINDOW], num_blocks=1 + 20 + 4, prefix_caching=True)
    tokens = list(range(40))
    run(blocks, "a", tokens, 8)
    blocks.reserve([SeqRequest("x", 20, list(range(100, 120)))], ())
    assert blocks.block_pool.prefix.num_evictions == 6
    blocks.free(["x"])
    request = SeqRequest("b", 25, [*tokens[:24], 99])
    assert len(blocks.prefix_blocks(request)) == 6, "a's first 24 tokens hold in both groups"
    blocks.reserve([request], ())
    assert blocks.stats().prefix_hit_tokens == 24
    blocks.check_invariants()


def test_a_hit_past_the_window_keeps_the_blocks_before_it_as_recent_as_its_own():
    # b's sliding table reads a's blocks 4 and 5 only; at b's end, a's blocks 0-3 of the sliding group rank
    # by their position beside b's, so evicting eight blocks takes both groups' blocks 4-7, not 0-3
    blocks = hybrid([0, WINDOW], num_blocks=1 + 20 + 4, prefix_caching=True)
    tokens = list(range(40))
    run(blocks, "a", tokens, 8)
    blocks.reserve([SeqRequest("x", 16, list(range(100, 116)))], ())
    blocks.free(["x"])
    evictions = blocks.block_pool.prefix.num_evictions
    run(blocks, "b", [*tokens[:24], 99], 25)
    blocks.reserve([SeqRequest("y", 32, list(range(200, 232)))], ())
    blocks.free(["y"])
    assert blocks.block_pool.prefix.num_evictions == evictions + 8
    assert len(blocks.prefix_blocks(SeqRequest("c", 17, [*tokens[:16], 98]))) == 4
    blocks.check_invariants()


def test_one_sliding_group_keeps_prefix_caching():
    blocks = hybrid([WINDOW], prefix_caching=True)
    tokens = list(range(40))
    blocks.reserve([SeqRequest("a", 40, tokens)], ())
    blocks.reserve((), [SeqRequest("a", 41, [40], num_computed=40)])
    blocks.free(["a"], {"a": 41})
    blocks.reserve([SeqRequest("b", 40, tokens)], ())
    assert len(blocks.prefix_blocks(SeqRequest("c", 40, tokens))) == 9
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


def test_a_pool_of_more_layers_than_any_model_is_refused_before_its_groups_are_listed():
    with pytest.raises(InvalidArgument, match="geometry.num_layers must be at most 4096, got 2147483647"):
        pool_groups(pool_request([], num_layers=2**31 - 1))
    assert len(pool_groups(pool_request([], num_layers=4096))[0].layers) == 4096


@pytest.mark.parametrize(
    ("windows", "groups"),
    [
        ([], [((0, 1), 0)]),
        ([0, 0], [((0, 1), 0)]),
        ([WINDOW, WINDOW], [((0, 1), WINDOW)]),
        ([0, WINDOW], [((0,), 0), ((1,), WINDOW)]),
    ],
)
def test_a_pools_groups_follow_the_windows(windows, groups):
    found = pool_groups(pool_request(windows))
    assert [(group.layers, group.window) for group in found] == groups


@pytest.mark.parametrize("windows", [[WINDOW], [0, -1]])
def test_bad_sliding_windows_are_refused(windows):
    with pytest.raises(InvalidArgument):
        pool_groups(pool_request(windows))


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
