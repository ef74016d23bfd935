"""Prefix matching, in one place: which leading blocks of a new sequence are already computed (in the
prefix index) or computed by the step that admits it (by a prompt before it in the same Reserve)."""

from collections.abc import Callable

from cache_service.prefix_cache import BlockHash, PrefixCache, chain
from cache_service.sequence import SeqState
from common.kv_groups import KVGroup

Hit = tuple[int, BlockHash]  # (block id, hash of the sequence's block it stands for)
Partial = tuple[int, int]  # (cached block, how many of its leading tokens the sequence shares)
Candidate = tuple[int | None, BlockHash]  # (indexed block or None, hash of the sequence's block)


def lookup(
    prefix: PrefixCache, seq: SeqState, num_tokens: int, block_size: int, partials: bool
) -> tuple[list[Hit], Partial | None]:
    """A new sequence's whole-block hits in the prefix index and, if `partials`, the block after them."""
    hits = match(seq, num_tokens, block_size, prefix.lookup)
    return hits, partial(prefix, seq, hits, num_tokens, block_size) if partials else None


def match(
    seq: SeqState, num_tokens: int, block_size: int, find: Callable[[BlockHash], int | None]
) -> list[Hit]:
    """The sequence's next full blocks (after its hashed ones) that `find` maps to a block, up to the
    first miss. Never the block of the last token: its logits are needed, so it is always computed."""
    if seq.token_ids is None:
        return []
    hits = []
    for _, hash_ in chain(
        seq.last_hash, seq.token_ids, block_size, len(seq.hashes), (num_tokens - 1) // block_size
    ):
        block_id = find(hash_)
        if block_id is None:
            break
        hits.append((block_id, hash_))
    return hits


def candidates(prefix: PrefixCache, seq: SeqState, num_tokens: int, block_size: int) -> list[Candidate]:
    """Every full block of a new sequence before its last token's, whether or not the index holds it (a
    sliding window's hit may skip blocks before the window)."""
    if seq.token_ids is None:
        return []
    stop = (num_tokens - 1) // block_size
    return [
        (prefix.lookup(hash_), hash_)
        for _, hash_ in chain(seq.last_hash, seq.token_ids, block_size, len(seq.hashes), stop)
    ]


def usable(found: list[Candidate], group: KVGroup, block_size: int) -> list[bool]:
    """usable[k] (k = 0..len(found)): whether a hit of the first k blocks holds in the group, every block
    the window of its first query (token k * block_size) reads being indexed; a full group's needs all k."""
    missing = [0]
    for block_id, _ in found:
        missing.append(missing[-1] + (block_id is None))
    return [
        missing[k] == missing[group.first_kept(k * block_size, block_size)] for k in range(len(found) + 1)
    ]


def window_hits(
    found: list[Candidate], count: int, group: KVGroup, block_size: int, null_block: int
) -> list[Hit]:
    """The first `count` blocks as hits (`usable` for count), those before the window holding null_block."""
    first = group.first_kept(count * block_size, block_size)
    hits = [
        (null_block if index < first else block_id, hash_)
        for index, (block_id, hash_) in enumerate(found[:count])
    ]
    assert all(block_id is not None for block_id, _ in hits), "not a usable hit"
    return hits


def partial(
    prefix: PrefixCache, seq: SeqState, hits: list[Hit], num_tokens: int, block_size: int
) -> Partial | None:
    """(cached block, tokens it shares) for the block after `hits` of a new sequence, when an indexed block
    starts with some (not all) of its tokens; never the last token."""
    if seq.token_ids is None:
        return None
    start = (len(seq.hashes) + len(hits)) * block_size
    limit = min(block_size, num_tokens - 1 - start)
    if limit <= 0:
        return None
    parent = hits[-1][1] if hits else seq.last_hash
    return prefix.longest_partial(parent, seq.token_ids[start : start + limit])


class StepBlocks:
    """The full blocks that the new sequences of one Reserve compute in its step, by hash, so a prompt
    later in the call shares them (compute writes every new token's K/V of a layer before any attention
    reads the pool). NOTE: they enter the prefix index only once their writer reports them written."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_hash: dict[BlockHash, int] = {}

    def match(self, seq: SeqState, num_tokens: int) -> list[Hit]:
        return match(seq, num_tokens, self.block_size, self._by_hash.get) if self._by_hash else []

    def add(self, seq: SeqState, num_tokens: int) -> None:
        """Records the full blocks the sequence computes this step (past its hashed ones)."""
        if seq.token_ids is None:
            return
        for index, hash_ in chain(
            seq.last_hash, seq.token_ids, self.block_size, len(seq.hashes), num_tokens // self.block_size
        ):
            self._by_hash.setdefault(hash_, seq.block_table[index])
