"""The block pool: the KV pool's block ids, each with a refcount, over the allocator and the prefix index
of cached blocks (the K/V data itself is in the KV pool tensor, never here)."""

from collections.abc import Sequence

from cache_service.allocators.base import BlockAllocator
from cache_service.prefix_cache import BlockHash, LoraTag, PrefixCache
from common.errors import InvalidArgument, ResourceExhausted

Parting = tuple[int, bool]  # a freed table's block, and whether the table held it (BlockPool.let_go)


class BlockPool:
    """Every block is in exactly one place: free (in the allocator), used (refcount > 0) or cached (in the
    prefix index with refcount 0, evicted least recently used when blocks run short)."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.prefix = PrefixCache()
        self.refcounts = [0] * allocator.num_total

    @property
    def num_total(self) -> int:
        return self.allocator.num_total

    @property
    def num_available(self) -> int:
        """Blocks `take` can hand out: free ones and evictable cached ones."""
        return self.allocator.num_free + self.prefix.num_evictable

    def ensure_available(self, need: int, revived: int, block_size: int) -> None:
        """ResourceExhausted unless `need` blocks can be taken once `revived` evictable ones are revived."""
        available = self.num_available - revived
        if need > available:
            raise ResourceExhausted(
                f"need {need} blocks, {available} free of {self.num_total} (block_size {block_size}): "
                "free or preempt sequences, or give the pool more memory"
            )

    def take(self, n: int, hint: Sequence[int]) -> list[int]:
        """n blocks with refcount 1, evicting least recently used cached blocks if too few are free.
        Requires n <= num_available."""
        short = n - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.prefix.evict(short))
        block_ids = self.allocator.allocate(n, hint)
        for block_id in block_ids:
            assert self.refcounts[block_id] == 0, block_id
            self.refcounts[block_id] = 1
        return block_ids

    def reference(self, block_id: int) -> None:
        """One more table holds the block (a cached block stops being evictable)."""
        if self.refcounts[block_id] == 0:
            self.prefix.revive(block_id)
        self.refcounts[block_id] += 1

    def release(self, block_id: int) -> bool:
        """Drops one reference; returns whether the block left use (freed, or kept as evictable cache)."""
        assert self.refcounts[block_id] > 0, block_id
        self.refcounts[block_id] -= 1
        if self.refcounts[block_id]:
            return False
        if self.prefix.is_indexed(block_id):
            self.prefix.park(block_id)
        else:
            self.allocator.free([block_id])
        return True

    def let_go(self, block_id: int, held: bool) -> bool:
        """A block a freed table held (`release`), or one of its sliding window's past that the index still
        keeps evictable, made the most recently used; returns whether a held block left use."""
        if held:
            return self.release(block_id)
        if self.prefix.is_evictable(block_id):
            self.prefix.touch(block_id)
        return False

    def refcount(self, block_id: int) -> int:
        """How many block tables hold the block; InvalidArgument if it is out of range."""
        if not 0 <= block_id < self.num_total:
            raise InvalidArgument(f"block {block_id} does not exist: the pool has {self.num_total} blocks")
        return self.refcounts[block_id]

    def register(
        self,
        block_id: int,
        hash_: BlockHash,
        parent: BlockHash,
        token_ids: Sequence[int],
        first: bool,
        lora: LoraTag | None = None,
    ) -> None:
        """Publishes a used, full block whose K/V is written, under hash_ = hash(parent, token_ids); `first`:
        its sequence's first block. An evictable block indexed under the same hash is freed, the block in
        use standing for it, so the prefix stays found as long as either would."""
        assert self.refcounts[block_id] > 0, block_id
        stale = self.prefix.lookup(hash_)
        if stale is not None and self.prefix.is_evictable(stale) and not self.prefix.is_indexed(block_id):
            self.prefix.take_over(stale, block_id)
            self.allocator.free([stale])
        else:
            self.prefix.register(block_id, hash_, parent, token_ids, first, lora)

    def must_copy(self, block_id: int, already_copied: int = 0) -> bool:
        """A block about to be written is copied first if another table holds it or the index publishes it
        (`already_copied`: references this batch will already have moved off it)."""
        return self.refcounts[block_id] - already_copied > 1 or self.prefix.is_indexed(block_id)

    def check_invariants(self, holders: list[int]) -> None:
        """Asserts: refcounts equal `holders` (tables holding each block); each block in exactly one place."""
        assert holders == self.refcounts, "refcounts differ from the block tables"
        for block_id, count in enumerate(self.refcounts):
            places = [count > 0, self.allocator.is_free(block_id), self.prefix.is_evictable(block_id)]
            assert places.count(True) == 1, f"block {block_id} (used, free, cached) = {places}"
        self.prefix.check_invariants()
