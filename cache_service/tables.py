"""What changes one sequence's block table in a Reserve, fork or free: prefix hits shared, a partly matched
block copied, full blocks indexed once written, shared blocks copied before they are written, growth.
cache_service.block_manager decides which of these a call runs; the counters are the manager's."""

from collections.abc import Callable

from cache_service.block_pool import BlockPool
from cache_service.prefix_cache import block_tokens, chain
from cache_service.prefix_match import Hit
from cache_service.sequence import SeqState
from cache_service.stats import Counters


class Tables:
    """Writes tables over `block_pool`: `copy_block(src, dst)` copies a block's K/V (copy-on-write)."""

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        copy_block: Callable[[int, int], None],
        counters: Counters,
    ) -> None:
        self.block_pool, self.block_size = block_pool, block_size
        self._copy_block, self._counters = copy_block, counters

    def share(self, seq: SeqState, hits: list[Hit], null_block: int = -1) -> int:
        """Appends the hit blocks to the table (one more reference each, none for null_block: a sliding
        window's past); returns how many."""
        for block_id, hash_ in hits:
            if block_id != null_block:
                self.block_pool.reference(block_id)
            seq.block_table.append(block_id)
            seq.hashes.append(hash_)
        seq.cached_tokens += len(hits) * self.block_size
        return len(hits)

    def copy_partial(self, seq: SeqState, source: int, shared: int) -> None:
        """The prefix ends `shared` tokens into `source`: the table gets a copy, since the rest is written."""
        (new,) = self.block_pool.take(1, seq.block_table)
        self._copy_block(source, new)
        seq.block_table.append(new)
        self.block_pool.release(source)
        seq.cached_tokens += shared
        self._counters.copy_on_writes += 1

    def register(self, seq: SeqState, num_computed: int) -> None:
        """Indexes the sequence's full blocks whose K/V is now written."""
        if seq.token_ids is None:
            return
        bs = self.block_size
        for index, hash_ in chain(seq.last_hash, seq.token_ids, bs, len(seq.hashes), num_computed // bs):
            tokens = block_tokens(seq.token_ids, index, bs)
            self.block_pool.register(
                seq.block_table[index], hash_, seq.last_hash, tokens, first=index == 0, lora=seq.lora
            )
            seq.hashes.append(hash_)

    def copy_on_write(self, seq: SeqState, first_written: int) -> None:
        for index in range(first_written, len(seq.block_table)):
            old = seq.block_table[index]
            if self.block_pool.must_copy(old):
                (new,) = self.block_pool.take(1, seq.block_table[:index])
                self._copy_block(old, new)
                seq.block_table[index] = new
                self.block_pool.release(old)
                self._counters.copy_on_writes += 1

    def grow(self, seq: SeqState, n: int) -> None:
        assert n >= 0, n
        seq.block_table.extend(self.block_pool.take(n, seq.block_table))

    def release(self, seq: SeqState, first_kept: int, null_block: int) -> int:
        """Releases the blocks before index first_kept (a sliding window's past), leaving null_block in their
        entries; returns how many it released."""
        released = 0
        for index in range(min(first_kept, len(seq.block_table))):
            if seq.block_table[index] != null_block:
                self.block_pool.release(seq.block_table[index])
                seq.block_table[index] = null_block
                released += 1
        return released
