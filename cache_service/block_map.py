"""The block map: every block's state and refcount, one byte each, for a live view of the pool."""

from cache_service.block_manager import BlockManager
from cache_service.hybrid_blocks import HybridBlocks
from protos import cache_pb2

FREE, USED, CACHED = cache_pb2.BLOCK_STATE_FREE, cache_pb2.BLOCK_STATE_USED, cache_pb2.BLOCK_STATE_CACHED
NULL = cache_pb2.BLOCK_STATE_NULL
# The largest refcount a byte reports; a higher one reads as this.
MAX_REFCOUNT = 255


def encode(blocks: BlockManager | HybridBlocks, epoch: str) -> cache_pb2.BlockMap:
    """The map of the pool `blocks` manages, at this moment (the caller holds the lock of every change).

    NOTE: a block is used iff its refcount is positive and cached iff evictable (BlockPool's invariant),
    so the states come from the refcounts and the evictable set alone, in one pass each; the null block
    (a pool with sliding-window groups) is marked as such whatever its refcount."""
    pool = blocks.block_pool
    refcounts = pool.refcounts
    states = bytearray(
        USED if count else CACHED if pool.prefix.is_evictable(block_id) else FREE
        for block_id, count in enumerate(refcounts)
    )
    if blocks.null_block >= 0:
        states[blocks.null_block] = NULL
    return cache_pb2.BlockMap(
        num_blocks=pool.num_total,
        block_size=blocks.block_size,
        states=bytes(states),
        refcounts=bytes(min(count, MAX_REFCOUNT) for count in refcounts),
        pool_epoch=epoch,
    )
