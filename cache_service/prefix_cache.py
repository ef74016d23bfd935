"""The prefix index: chained hashes of full, written blocks, and the LRU order of unreferenced ones."""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
# The LoRA adapter whose KV a block holds: compute's id and the adapter's name (None: the base model's).
LoraTag = tuple[int, str]


def root_hash(model: str, cache_salt: str, adapter: str = "") -> BlockHash:
    """The parent key of a sequence's first block: only requests with equal model, salt and LoRA adapter
    (SeqRequest.adapter; empty: the base model) share blocks."""
    key = f"{model}\0{cache_salt}" + (f"\0{adapter}" if adapter else "")
    return BlockHash(hashlib.blake2b(key.encode(), digest_size=16).digest())


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """hash(parent hash, the block's token ids): equal hashes mean equal whole prefixes."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return BlockHash(digest.digest())


def block_tokens(token_ids: Sequence[int], index: int, block_size: int) -> Sequence[int]:
    """The tokens of block `index`."""
    return token_ids[index * block_size : (index + 1) * block_size]


class PrefixListener:
    """What a tier (cache_service/tiers/manager.py) or the KV event publisher (cache_service/kv_events.py)
    learns of the prefix index; this one ignores it all.
    NOTE: called under the cache's lock, while the block's K/V is still the hash's: a listener that wants the
    bytes copies them before returning (an evicted block is handed out right after)."""

    def cached(
        self,
        block_id: int,
        hash_: BlockHash,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        lora: LoraTag | None = None,
    ) -> None:
        """The block's K/V is written and indexed under hash_ = hash(parent's hash, token_ids); parent is
        None for a sequence's first block (its parent key is the root, no block's); `lora`: the adapter the
        K/V was computed through (None: the base model)."""

    def reused(self, hits: Sequence[tuple[int, BlockHash]]) -> None:
        """A new sequence (with token ids) looked the index up; it shares these (block, hash) hits."""

    def evicted(self, block_id: int, hash_: BlockHash) -> None:
        """The block leaves the index; its K/V is overwritten once this returns."""

    def moved(self, stale: int, block_id: int) -> None:
        """block_id, holding the same K/V, now stands for stale's hash; stale leaves the index."""


def chain(
    parent: BlockHash, token_ids: Sequence[int], block_size: int, start: int, stop: int
) -> Iterator[tuple[int, BlockHash]]:
    """(index, hash) of the full blocks start..stop-1 of `token_ids`, each hashed on the one before;
    `parent` is the hash of block start - 1 (the root for block 0). The one walker of the hash chain."""
    assert 0 <= stop * block_size <= len(token_ids), (stop, block_size, len(token_ids))
    for index in range(start, stop):
        parent = block_hash(parent, block_tokens(token_ids, index, block_size))
        yield index, parent


class PrefixCache:
    """Maps block hashes to the physical blocks holding them; knows nothing about refcounts.

    A block is either not indexed, indexed and referenced, or indexed and unreferenced (evictable, kept in
    LRU order). NOTE: the first block registered for a hash wins; a later block with the same content stays
    unindexed and is freed normally when released.
    """

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, int] = {}
        self._entry: dict[int, tuple[BlockHash, BlockHash, tuple[int, ...]]] = {}  # hash, parent, tokens
        self._children: dict[BlockHash, set[int]] = {}  # parent hash -> indexed blocks that follow it
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0
        self.listeners: list[PrefixListener] = []

    @property
    def num_indexed(self) -> int:
        return len(self._entry)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, block_hash_: BlockHash) -> int | None:
        return self._by_hash.get(block_hash_)

    def is_indexed(self, block_id: int) -> bool:
        return block_id in self._entry

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def register(
        self,
        block_id: int,
        hash_: BlockHash,
        parent: BlockHash,
        token_ids: Sequence[int],
        first: bool,
        lora: LoraTag | None = None,
    ) -> None:
        """Indexes a written, full, used block under hash_ = hash(parent, token_ids), unless that hash (or
        the block) is indexed already; `first`: it is its sequence's first block (parent is the root);
        `lora`: its sequence's adapter, for the listeners."""
        if hash_ not in self._by_hash and block_id not in self._entry:
            self._by_hash[hash_] = block_id
            self._entry[block_id] = (hash_, parent, tuple(token_ids))
            self._children.setdefault(parent, set()).add(block_id)
            for listener in self.listeners:
                listener.cached(block_id, hash_, None if first else parent, token_ids, lora)

    def take_over(self, stale: int, block_id: int) -> None:
        """block_id (used, unindexed, its K/V written) stands for evictable `stale`'s hash from now on: stale
        leaves the index, not evicted (the caller frees it; its K/V lives on in block_id)."""
        assert stale in self._evictable and block_id not in self._entry, (stale, block_id)
        del self._evictable[stale]
        hash_, parent, _ = self._entry[block_id] = self._entry.pop(stale)
        self._by_hash[hash_] = block_id
        self._children[parent].remove(stale)
        self._children[parent].add(block_id)
        for listener in self.listeners:
            listener.moved(stale, block_id)

    def longest_partial(self, parent: BlockHash, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(block, n): the indexed block after `parent` whose tokens start with the most (n >= 1) of
        `token_ids`, for a prompt whose cached prefix ends inside a block; None if none shares a token."""
        best = None
        for block_id in self._children.get(parent, ()):
            tokens, n = self._entry[block_id][2], 0
            while n < len(token_ids) and tokens[n] == token_ids[n]:
                n += 1
            if n and (best is None or n > best[1]):
                best = (block_id, n)
        return best

    def park(self, block_id: int) -> None:
        """An indexed block lost its last reference: evictable, most recently used."""
        assert block_id in self._entry and block_id not in self._evictable, block_id
        self._evictable[block_id] = None

    def touch(self, block_id: int) -> None:
        """An evictable block becomes the most recently used (its prefix's other blocks were released now)."""
        self._evictable.move_to_end(block_id)

    def revive(self, block_id: int) -> None:
        """An evictable block is referenced again by a prefix hit."""
        del self._evictable[block_id]

    def evict(self, n: int) -> list[int]:
        """Drops the n least recently used evictable blocks from the index and returns them."""
        assert 0 <= n <= len(self._evictable), (n, len(self._evictable))
        evicted = []
        for _ in range(n):
            block_id, _ = self._evictable.popitem(last=False)
            hash_, parent, _ = self._entry.pop(block_id)
            for listener in self.listeners:
                listener.evicted(block_id, hash_)
            del self._by_hash[hash_]
            siblings = self._children[parent]
            siblings.remove(block_id)
            if not siblings:
                del self._children[parent]
            evicted.append(block_id)
        self.num_evictions += n
        return evicted

    def by_recency(self) -> list[tuple[int, BlockHash]]:
        """(block, hash) of every indexed block, most recently used first: those in use now, then the
        evictable ones from the last released on."""
        used = [block_id for block_id in self._entry if block_id not in self._evictable]
        return [(block_id, self._entry[block_id][0]) for block_id in (*used, *reversed(self._evictable))]

    def tokens(self, block_id: int) -> tuple[int, ...]:
        return self._entry[block_id][2]

    def check_invariants(self) -> None:
        """Asserts: each indexed block's hash is hash(parent, tokens); index and reverse map agree."""
        assert len(self._by_hash) == len(self._entry)
        for block_id, (hash_, parent, tokens) in self._entry.items():
            assert self._by_hash[hash_] == block_id, block_id
            assert block_hash(parent, tokens) == hash_, f"block {block_id} holds other tokens than its hash"
        assert all(block_id in self._entry for block_id in self._evictable)
        assert {(p, b) for p, blocks in self._children.items() for b in blocks} == {
            (parent, block_id) for block_id, (_, parent, _) in self._entry.items()
        }, "the children map disagrees with the index"
