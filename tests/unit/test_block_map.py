"""The block map (Cache.GetBlockMap's reply): one byte of state and one of refcount per block, equal to what
the block manager holds, and small."""

import pytest
import structlog

from cache_service import block_map
from cache_service.allocators import registry
from cache_service.block_manager import BlockManager
from cache_service.block_map import CACHED, FREE, MAX_REFCOUNT, USED
from cache_service.sequence import SeqRequest
from cache_service.servicer import CacheServicer
from common.errors import FailedPrecondition
from protos import cache_pb2
from tests.blocks import allocate

BLOCK_SIZE = 4


def manager(num_blocks: int) -> BlockManager:
    return BlockManager(registry.create("freelist", num_blocks), BLOCK_SIZE, model="m")


def expected_state(blocks: BlockManager, block_id: int) -> int:
    pool = blocks.block_pool
    if pool.refcounts[block_id]:
        return USED
    return CACHED if pool.prefix.is_evictable(block_id) else FREE


def test_each_block_has_its_state_and_refcount():
    blocks = manager(16)
    tokens = list(range(10))  # 3 blocks: two full, one partly filled
    (kept,) = allocate(blocks, [SeqRequest("kept", 10, tokens)])
    blocks.fork("kept", ["child"])  # every block of "kept" is shared
    (gone,) = allocate(blocks, [SeqRequest("gone", 8, [50 + t for t in range(8)])])
    blocks.free(["gone"], {"gone": 8})  # its two full, written blocks stay cached
    reply = block_map.encode(blocks, "epoch-1")

    assert (reply.num_blocks, reply.block_size, reply.pool_epoch) == (16, BLOCK_SIZE, "epoch-1")
    assert len(reply.states) == len(reply.refcounts) == 16
    assert [reply.states[b] for b in kept] == [USED] * 3
    assert [reply.refcounts[b] for b in kept] == [2] * 3
    assert [reply.states[b] for b in gone] == [CACHED] * 2
    assert list(reply.states).count(FREE) == 16 - 3 - 2
    for block_id in range(16):
        assert reply.states[block_id] == expected_state(blocks, block_id), block_id
        assert reply.refcounts[block_id] == blocks.refcount(block_id), block_id
    stats = blocks.stats()
    counts = [list(reply.states).count(state) for state in (FREE, USED, CACHED)]
    assert counts == [stats.free_blocks, stats.used_blocks, stats.cached_blocks]


def test_refcounts_above_a_byte_read_as_255():
    blocks = manager(4)
    (table,) = allocate(blocks, [SeqRequest("parent", 3)])
    blocks.fork("parent", [f"child-{i}" for i in range(300)])
    reply = block_map.encode(blocks, "e")
    assert blocks.refcount(table[0]) == 301
    assert reply.refcounts[table[0]] == MAX_REFCOUNT
    assert reply.states[table[0]] == USED


def test_a_large_pool_maps_in_a_few_bytes_per_block():
    blocks = manager(100_000)
    allocate(blocks, [SeqRequest(f"s{i}", 64 * BLOCK_SIZE, list(range(64 * BLOCK_SIZE))) for i in range(100)])
    reply = block_map.encode(blocks, "e")
    assert len(reply.SerializeToString()) < 2 * 100_000 + 64
    assert list(reply.states).count(USED) == blocks.stats().used_blocks


def test_before_a_pool_exists_the_map_is_refused_with_what_to_do():
    servicer = CacheServicer("freelist", 16, 0, structlog.get_logger())
    with pytest.raises(FailedPrecondition, match="call CreatePool first"):
        servicer.GetBlockMap(cache_pb2.GetBlockMapRequest(), None)
