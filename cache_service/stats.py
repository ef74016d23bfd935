"""The block manager's statistics: the snapshot GetStats reports, and the counters kept as tables change."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cache_service.block_pool import BlockPool


@dataclass(frozen=True, slots=True)
class BlockStats:
    total_blocks: int
    used_blocks: int  # referenced by a table
    free_blocks: int  # in the allocator
    cached_blocks: int  # in the prefix index, unreferenced, evictable
    num_sequences: int
    block_size: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    copy_on_writes: int
    evictions: int
    stored_tokens: int  # tokens the tables hold, summed over sequences
    table_slots: int  # token slots of the blocks the tables hold (block_size per entry), summed likewise

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks


@dataclass(slots=True)
class Counters:
    """Running totals. NOTE: Σ num_tokens and Σ table lengths over sequences are kept as tables change,
    never recounted."""

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    copy_on_writes: int = 0
    stored_tokens: int = 0
    table_blocks: int = 0

    def account(self, tokens: int, blocks: int) -> None:
        """A table gained (or, negative, lost) `tokens` tokens and `blocks` entries."""
        self.stored_tokens += tokens
        self.table_blocks += blocks

    def snapshot(self, block_pool: "BlockPool", num_sequences: int, block_size: int) -> BlockStats:
        free, total = block_pool.allocator.num_free, block_pool.num_total
        cached, evictions = block_pool.prefix.num_evictable, block_pool.prefix.num_evictions
        return BlockStats(
            total, total - free - cached, free, cached, num_sequences, block_size,
            self.prefix_query_tokens, self.prefix_hit_tokens, self.copy_on_writes, evictions,
            self.stored_tokens, self.table_blocks * block_size,
        )  # fmt: skip
