"""The hybrid KV manager: one block manager per KV group (common/kv_groups.py) over one block pool, so a
sequence holds one table per group, and a sliding group's tables release the blocks out of its window
while the full-attention groups keep theirs. Block ids come from one free list: a block id holds the K/V
of group_size layers of whichever group's table holds it.

Prefix caching: each group indexes its own blocks (its hashes on a root of its own); a new sequence's hit
is the longest prefix that holds in every group: a full group needs every block of it indexed, a sliding
group only the blocks the window of the first computed token reads (the rest of its table, the null block).
A released block of a sliding group stays indexed and evictable, as a freed sequence's does."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from cache_service.admission import Agreed
from cache_service.allocators.base import BlockAllocator
from cache_service.block_manager import BlockManager
from cache_service.block_pool import BlockPool
from cache_service.prefix_match import Hit, usable, window_hits
from cache_service.sequence import SeqRequest, TableTail
from cache_service.stats import BlockStats
from common.kv_groups import KVGroup


class HybridBlocks:
    """Per sequence a table in every group, all changed together, each call all or nothing; a new sequence
    shares the same number of prefix blocks in every group (`agreed_hits`)."""

    def __init__(
        self,
        allocator: BlockAllocator,
        groups: Sequence[KVGroup],
        block_size: int,
        copy_block: Callable[[int, int], None] = lambda src, dst: None,
        prefix_caching: bool = True,
        model: str = "",
    ) -> None:
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
                group_identity(model, index, len(groups)),
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
        hits = self.agreed_hits(new)
        need = sum(
            manager.step_need(new, running, each) for manager, each in zip(self.managers, hits, strict=True)
        )
        self.block_pool.ensure_available(need, 0, self.block_size)
        return [
            manager.reserve(new, running, each) for manager, each in zip(self.managers, hits, strict=True)
        ]

    def agreed_hits(self, new: Sequence[SeqRequest]) -> list[Agreed | None]:
        """Per group, each valid new request's prefix hits: the longest prefix of whole blocks that every
        group holds (`prefix_match.usable`), a sliding group's entries before its window the null block;
        None (each group's own lookup) without prefix caching or with one group."""
        if not self.prefix_caching or len(self.managers) == 1:
            return [None] * len(self.managers)
        hits: list[dict[str, list[Hit]]] = [{} for _ in self.managers]
        for request in new:
            found = [manager.hit_candidates(request) for manager in self.managers]
            holds = [
                usable(each, group, self.block_size) for each, group in zip(found, self.groups, strict=True)
            ]
            count = max((k for k in range(len(holds[0])) if all(h[k] for h in holds)), default=0)
            for per_group, each, group in zip(hits, found, self.groups, strict=True):
                per_group[request.seq_id] = window_hits(each, count, group, self.block_size, self.null_block)
        return hits

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
        """BlockManager.free in every group; returns the blocks that left use, all groups together. Each
        sequence's blocks go tail first, one table index in every group at a time, so eviction cuts every
        group's prefix alike (a hit holds only as far as every group holds it)."""
        # NOTE: every group holds the same sequences, so the first group's checks raise for all of them.
        partings = [manager.detach(seq_ids, num_computed, appended) for manager in self.managers]
        released = 0
        for per_group in zip(*partings, strict=True):
            for index in reversed(range(max(map(len, per_group)))):
                for parting in per_group:
                    if index < len(parting) and parting[index] is not None:
                        released += self.block_pool.let_go(*parting[index])
        return released

    def index_written(self, num_computed: Mapping[str, int]) -> None:
        """BlockManager.index_written in every group (without prefix caching it only checks the counts)."""
        for manager in self.managers:
            manager.index_written(num_computed)

    def prefix_blocks(self, request: SeqRequest) -> list[int]:
        """The first group's blocks of the request's agreed prefix hits (`agreed_hits`), in order."""
        first = self.agreed_hits([request])[0]
        if first is None:
            return self.managers[0].prefix_blocks(request)
        return [block_id for block_id, _ in first[request.seq_id]]

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


def group_identity(model: str, index: int, num_groups: int) -> str:
    """The root of a group's prefix hashes: the model's for a pool of one group, else the model's and the
    group's (a block of one group holds other layers than the same tokens' block of another)."""
    return model if num_groups == 1 else f"{model}\0group {index}"
