"""A tier joined to the pool: which blocks are written to it (evicted ones, hot ones) and when blocks come
back from it (a new prompt's prefix missing from the pool, before Reserve looks the prefix cache up)."""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cache_service.block_manager import BlockManager
from cache_service.hybrid_blocks import group_identity
from cache_service.kv_pool import KVPool
from cache_service.prefix_cache import BlockHash, LoraTag, PrefixListener, block_tokens, chain, root_hash
from cache_service.sequence import SeqRequest, check_prompt
from cache_service.tiers import record, registry
from cache_service.tiers.base import KVTier, TierError
from cache_service.tiers.writer import TierWriter
from protos import cache_pb2


@dataclass(frozen=True, slots=True)
class StopFlush:
    """What a stopping cache service (SIGTERM) writes to the tier: the queued writes, then the indexed blocks
    the tier lacks, most recently used first, up to max_bytes of them, all within timeout_s."""

    max_bytes: int = 2 * 2**30
    timeout_s: float = 20.0


@dataclass(slots=True)
class LoadCounters:
    hit_blocks: int = 0  # loaded into the pool
    miss_blocks: int = 0  # looked up, not held (one per prompt at most: its chain stops there)
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    corrupt_records: int = 0  # found corrupt on load: deleted, never served
    errors: int = 0  # loads the tier failed
    skipped_blocks: int = 0  # held maybe, not looked up: no free block, or the Reserve's load limit reached


@dataclass(slots=True)
class _Cached:
    """An indexed block as the hot policy sees it."""

    hash_: BlockHash
    cached_at: int  # prefix lookups counted when it was indexed
    hits: int = 0
    written: bool = False  # queued for the tier, or loaded from it


class TierManager(PrefixListener):
    """Writes a block to the tier when it is evicted from the pool, or once it is hot: its prefix hits reach
    `hot_threshold` x the prefix lookups since it was cached (0: as soon as it is cached). Loads at most
    `max_load_blocks` blocks per Reserve, into free blocks only (never evicting a cached block)."""

    def __init__(
        self,
        tier: KVTier,
        hot_threshold: float,
        max_load_blocks: int,
        queue_bytes: int,
        log,
        stop_flush: StopFlush = StopFlush(),
    ):
        assert 0.0 <= hot_threshold <= 1.0 and max_load_blocks >= 0, (hot_threshold, max_load_blocks)
        self.tier = tier
        self.hot_threshold = hot_threshold
        self.max_load_blocks = max_load_blocks
        self.stop_flush = stop_flush
        self.counters = LoadCounters()
        self._log = log
        self._writer = TierWriter(
            tier, queue_bytes, lambda err: log.warning("kv_tier_write_failed", error=err)
        )
        self._pool: KVPool | None = None
        self._cached: dict[int, _Cached] = {}
        self._lookups = 0

    def attach(self, pool: KVPool) -> None:
        """Joins the new pool: its blocks' keys carry its layout's fingerprint."""
        assert self._pool is None, "one pool per cache service"
        self._pool = pool
        self._fingerprint = record.fingerprint(pool.spec)
        self._block_shape = pool.tensor[:, :, 0].view(torch.uint8).shape
        self._block_bytes = self._block_shape.numel()
        pool.blocks.block_pool.prefix.listeners.append(self)

    # writing (PrefixListener: under the cache's lock, inside Reserve or Free)

    def cached(
        self,
        block_id: int,
        hash_: BlockHash,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        lora: LoraTag | None = None,
    ) -> None:
        self._cached[block_id] = entry = _Cached(hash_, self._lookups)
        if self.hot_threshold == 0.0:
            self._write(block_id, entry)

    def reused(self, hits: Sequence[tuple[int, BlockHash]]) -> None:
        self._lookups += 1
        for block_id, _ in hits:
            entry = self._cached[block_id]
            entry.hits += 1
            if not entry.written and entry.hits >= self.hot_threshold * (self._lookups - entry.cached_at):
                self._write(block_id, entry)

    def evicted(self, block_id: int, hash_: BlockHash) -> None:
        self._write(block_id, self._cached.pop(block_id))

    def moved(self, stale: int, block_id: int) -> None:
        self._cached[block_id] = self._cached.pop(stale)

    def _write(self, block_id: int, entry: _Cached) -> None:
        """Queues a copy of the block's bytes unless the tier holds it or it is queued; the copy is taken here
        (cheap: one block) and encoded and stored on the writer thread."""
        key = record.key(self._fingerprint, entry.hash_)
        if self.tier.contains(key) or self._writer.is_pending(key):
            entry.written = True
        elif self._writer.has_room(self._block_bytes):
            # NOTE: numpy copies the strided block far faster than torch's copy_ of a uint8 view does.
            self._writer.offer(key, np.array(self._bytes_of(block_id), order="C"))
            entry.written = True

    # loading (under the cache's lock, in Reserve before the prefix lookups)

    def load_prefixes(self, blocks: BlockManager, new: Sequence[SeqRequest]) -> None:
        """Loads, for each new prompt, the full blocks after its pool hits that the tier holds (up to the
        first it lacks; never the block of the last token), as cached blocks a Lookup or Reserve then finds.
        The prompts are checked first: an invalid one (InvalidArgument) loads nothing; a Reserve refused for
        lack of blocks keeps what it loaded, cached and evictable, as a computed prefix would be."""
        for request in new:
            check_prompt(request)
        if self._pool is None or not blocks.prefix_caching or not any(r.token_ids for r in new):
            return
        budget = self.max_load_blocks
        for request in new:
            if request.token_ids:
                budget -= self._load_prefix(request, budget)

    def _load_prefix(self, request: SeqRequest, budget: int) -> int:
        """Loads the request's prefix in each KV group: every block of it in a full-attention group (or the
        one group), then the blocks a sliding group's window reads at the end of the prefix all of those
        reach; returns the blocks loaded."""
        groups, block_size = self._pool.groups, self._pool.spec.block_size
        stop, loaded = (request.num_tokens - 1) // block_size, 0
        sliding = [bool(group.window) and len(groups) > 1 for group in groups]
        for index in sorted(range(len(groups)), key=sliding.__getitem__):
            root = root_hash(
                group_identity(self._pool.identity, index, len(groups)), request.cache_salt, request.adapter
            )
            start = groups[index].first_kept(stop * block_size, block_size) if sliding[index] else 0
            reach, count = self._load_chain(root, request, start, stop, budget - loaded)
            loaded += count
            stop = stop if sliding[index] else reach
        return loaded

    def _load_chain(
        self, root: BlockHash, request: SeqRequest, start: int, stop: int, budget: int
    ) -> tuple[int, int]:
        """Loads blocks start..stop-1 of the chain from `root` that the pool lacks, up to the first the tier
        lacks too; returns (that block's index, or stop; the blocks loaded)."""
        block_pool, block_size = self._pool.blocks.block_pool, self._pool.spec.block_size
        parent, loaded = root, 0
        for index, hash_ in chain(root, request.token_ids, block_size, 0, stop):
            if index >= start and block_pool.prefix.lookup(hash_) is None:
                if loaded == budget or block_pool.allocator.num_free == 0:
                    self.counters.skipped_blocks += stop - index
                    return index, loaded
                tokens = block_tokens(request.token_ids, index, block_size)
                if not self._load_block(hash_, parent, tokens, first=index == 0):
                    return index, loaded
                loaded += 1
            parent = hash_
        return stop, loaded

    def _load_block(self, hash_: BlockHash, parent: BlockHash, tokens: Sequence[int], first: bool) -> bool:
        """Copies the block's record into a free block and indexes it (unreferenced, evictable); False when
        the tier lacks it, fails, or holds a corrupt record (then deleted)."""
        key, start = record.key(self._fingerprint, hash_), time.perf_counter()
        try:
            # NOTE: load, not contains first: a shared tier's local index lacks what other stacks stored.
            stored = self.tier.load(key)
            if stored is None:
                self.counters.miss_blocks += 1
                return False
            payload = record.decode(stored, self._block_bytes)
        except TierError as err:
            self.counters.errors += 1
            self._log.warning("kv_tier_load_failed", error=str(err))
            return False
        except record.CorruptRecord as err:
            self.counters.corrupt_records += 1
            self._log.warning("kv_tier_corrupt_record", key=key.hex(), reason=str(err))
            self._delete(key)
            return False
        block_pool = self._pool.blocks.block_pool
        (block_id,) = block_pool.take(1, [])
        self._bytes_of(block_id)[...] = np.frombuffer(payload, np.uint8).reshape(self._block_shape)
        block_pool.register(block_id, hash_, parent, tokens, first)
        self._cached[block_id].written = True
        block_pool.release(block_id)
        self.counters.hit_blocks += 1
        self.counters.loaded_bytes += len(payload)
        self.counters.load_seconds += time.perf_counter() - start
        return True

    def _bytes_of(self, block_id: int) -> np.ndarray:
        """The block's K/V of every layer as bytes: a strided view of the pool."""
        return self._pool.tensor[:, :, block_id].view(torch.uint8).numpy()

    def _delete(self, key: bytes) -> None:
        try:
            self.tier.delete(key)
        except TierError as err:
            self.counters.errors += 1
            self._log.warning("kv_tier_delete_failed", error=str(err))

    # reporting, stopping

    def stats(self) -> cache_pb2.TierStats:
        usage, load, write = self.tier.usage(), self.counters, self._writer.counters
        return cache_pb2.TierStats(
            name=self.tier.name,
            location=self.tier.location,
            hit_blocks=load.hit_blocks,
            miss_blocks=load.miss_blocks,
            loaded_bytes=load.loaded_bytes,
            load_seconds=load.load_seconds,
            corrupt_records=load.corrupt_records,
            skipped_blocks=load.skipped_blocks,
            written_blocks=write.written_blocks,
            written_bytes=write.written_bytes,
            write_drops=write.drops,
            errors=load.errors + write.errors,
            queued_blocks=self._writer.queued,
            stored_blocks=usage.records,
            stored_bytes=usage.bytes,
            budget_bytes=usage.budget_bytes,
            evictions=usage.evictions,
        )

    def close(self) -> None:
        """A planned stop: stores the queued writes, then flushes the indexed blocks (see StopFlush), then
        closes the tier."""
        deadline = time.monotonic() + self.stop_flush.timeout_s
        if self._writer.close(self.stop_flush.timeout_s) and self._pool is not None:
            self._flush(deadline)
        self.tier.close()

    def _flush(self, deadline: float) -> None:
        """Stores each indexed block the tier lacks, most recently used first, until stop_flush.max_bytes
        are tried or the deadline; logs what it stored and why it stopped."""
        start, tried, stored, stopped_by = time.monotonic(), 0, 0, "done"
        blocks = self._pool.blocks.block_pool.prefix.by_recency()
        keys = [(block_id, record.key(self._fingerprint, hash_)) for block_id, hash_ in blocks]
        missing = [(block_id, key) for block_id, key in keys if not self.tier.contains(key)]
        for block_id, key in missing:
            if (tried + 1) * self._block_bytes > self.stop_flush.max_bytes:
                stopped_by = "max_bytes"
                break
            if time.monotonic() >= deadline:
                stopped_by = "timeout"
                break
            tried += 1
            stored += self._writer.store(key, np.array(self._bytes_of(block_id), order="C"))
        self._log.info(
            "kv_tier_flushed",
            blocks=stored,
            bytes=stored * self._block_bytes,
            seconds=round(time.monotonic() - start, 3),
            cached_blocks=len(blocks),
            left_blocks=len(missing) - tried,
            failed_blocks=tried - stored,
            stopped_by=stopped_by,
        )


class NoTier:
    """The service without a tier: every hook does nothing."""

    def attach(self, pool: KVPool) -> None: ...

    def load_prefixes(self, blocks, new) -> None: ...

    def stats(self) -> None:
        return None

    def close(self) -> None: ...


def from_args(args, log) -> TierManager | NoTier:
    """The tier the resolved flags name, opened; TierError if it cannot be."""
    cls = registry.resolve(args.kv_tier)
    if cls is None:
        return NoTier()
    tier = cls(args.kv_tier_path, args.kv_tier_budget)
    usage = tier.usage()
    log.info(
        "kv_tier_opened", tier=tier.name, location=tier.location, blocks=usage.records, bytes=usage.bytes
    )
    flush = StopFlush(args.kv_tier_flush, args.kv_tier_flush_timeout)
    return TierManager(tier, args.kv_tier_hot, args.kv_tier_max_load, args.kv_tier_queue, log, flush)
