"""The hybrid KV manager: one block manager per KV group (common/kv_groups.py) over one block pool, so a
sequence holds one table per group, and a sliding group's tables release the blocks out of its window
while the full-attention groups keep theirs. Block ids come from one free list: a block id holds the K/V
of group_size layers of whichever group's table holds it."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from cache_service.allocators.base import BlockAllocator
from cache_service.block_manager import BlockManager
from cache_service.block_pool import BlockPool
from cache_service.sequence import SeqRequest, TableTail
from cache_service.stats import BlockStats
from common.errors import InvalidArgument
from common.kv_groups import KVGroup


class HybridBlocks:
    """Per sequence a table in every group, all changed together, each call all or nothing.

    NOTE: with one group this is that group's block manager (same identity, same hashes, no null block);
    with several, each group's prefix hashes have their own root, and prefix caching is refused (a hit is
    valid only when every group holds it, which the managers do not yet agree on).
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        groups: Sequence[KVGroup],
        block_size: int,
        copy_block: Callable[[int, int], None] = lambda src, dst: None,
        prefix_caching: bool = True,
        model: str = "",
    ) -> None:
        if len(groups) > 1 and prefix_caching:
            raise InvalidArgument(
                f"prefix caching over {len(groups)} KV groups is not supported: run the cache service with "
                "--no-prefix-cache for a model with both full and sliding-window layers"
            )
        self.groups = tuple(groups)
        self.allocator = allocator
        self.block_pool = BlockPool(allocator)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        windowed = any(group.window for group in groups)
        self.null_block = self.block_pool.take(1, [])[0] if windowed else -1
        self.managers = [
            BlockManager(
                allocator,
                block_size,
                copy_block,
                prefix_caching,
                model if len(groups) == 1 else f"{model}\0group {index}",
                group,
                self.block_pool,
                self.null_block,
            )
            for index, group in enumerate(groups)
        ]

    @property
    def num_available(self) -> int:
        """Blocks a reservation can take: free plus cached (evictable)."""
        return self.block_pool.num_available

    def check(self, new: Sequence[SeqRequest], running: Sequence[SeqRequest]) -> None:
        """Raises as `reserve` does when the batch is invalid; changes nothing."""
        for manager in self.managers:
            manager.check(new, running)

    def reserve(self, new: Sequence[SeqRequest], running: Sequence[SeqRequest]) -> list[list[TableTail]]:
        """BlockManager.reserve in every group: per group, the tails of `new` then `running`. Raises as it
        does, ResourceExhausted when the groups together lack blocks; on any error nothing changed."""
        self.check(new, running)
        need = sum(manager.step_need(new, running) for manager in self.managers)
        self.block_pool.ensure_available(need, 0, self.block_size)
        return [manager.reserve(new, running) for manager in self.managers]

    def fork(self, parent_id: str, child_ids: Sequence[str]) -> list[list[list[int]]]:
        """BlockManager.fork in every group: per group, the children's tables."""
        # NOTE: every group holds the same sequences, so the first group's checks raise for all of them.
        return [manager.fork(parent_id, child_ids) for manager in self.managers]

    def free(
        self,
        seq_ids: Sequence[str],
        num_computed: Mapping[str, int] | None = None,
        appended: Mapping[str, Sequence[int]] | None = None,
    ) -> int:
        """BlockManager.free in every group; returns the blocks that left use, all groups together."""
        return sum(manager.free(seq_ids, num_computed, appended) for manager in self.managers)

    def index_written(self, num_computed: Mapping[str, int]) -> None:
        """BlockManager.index_written in every group (without prefix caching it only checks the counts)."""
        for manager in self.managers:
            manager.index_written(num_computed)

    def prefix_blocks(self, request: SeqRequest) -> list[int]:
        """No blocks: prefix caching is off over several groups."""
        return self.managers[0].prefix_blocks(request)

    def refcount(self, block_id: int) -> int:
        """How many block tables of all groups hold the block; InvalidArgument if it is out of range."""
        return self.block_pool.refcount(block_id)

    def stats(self) -> BlockStats:
        """One group's counts of sequences and tokens, the pool's of blocks, every group's table slots and
        copies on write summed."""
        each = [manager.stats() for manager in self.managers]
        return replace(
            each[0],
            table_slots=sum(stats.table_slots for stats in each),
            copy_on_writes=sum(stats.copy_on_writes for stats in each),
        )

    def block_tables(self, seq_id: str) -> list[list[int]]:
        """The sequence's table in each group (a sliding one's released entries hold null_block)."""
        return [manager.block_table(seq_id) for manager in self.managers]

    def held_blocks(self) -> list[int]:
        """Per group, the blocks its tables hold, summed over sequences (a shared block once per table)."""
        return [manager.stats().table_slots // self.block_size for manager in self.managers]

    def check_invariants(self) -> None:
        """Asserts every group's tables' invariants, and the pool's over all groups' tables together."""
        holders = [0] * self.block_pool.num_total
        for manager in self.managers:
            holders = [a + b for a, b in zip(holders, manager.holders(), strict=True)]
        if self.null_block >= 0:
            holders[self.null_block] += 1
        self.block_pool.check_invariants(holders)
