"""New sequences in a Reserve: each one's prefix hits (its table's own lookup, or the hits every KV group
agreed on), the partly matched block it copies, the blocks another prompt of the same call computes, and
its table grown to the tokens of its first chunk. cache_service.block_manager decides when; what changes a
table is cache_service.tables."""

from collections.abc import Callable, Mapping, MutableMapping, Sequence

from cache_service.block_pool import BlockPool
from cache_service.prefix_match import Hit, Partial, StepBlocks, lookup
from cache_service.sequence import SeqRequest, SeqState
from cache_service.stats import Counters
from cache_service.tables import Tables
from common.paging import blocks_for

# Per new sequence, the prefix hits to share instead of the table's own lookup (cache_service.hybrid_blocks
# agrees them over every KV group): no partly matched block, none another prompt of the call computes.
Agreed = Mapping[str, list[Hit]]


class Admission:
    """Admits new sequences into one manager's tables over `block_pool`; `new_state(request)` is a new
    sequence's state (its tokens when prefix-cached, the root of its hash chain)."""

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        tables: Tables,
        counters: Counters,
        null_block: int,
        new_state: Callable[[SeqRequest], SeqState],
    ) -> None:
        self.block_pool, self.block_size = block_pool, block_size
        self._tables, self._counters = tables, counters
        self._null_block, self._new_state = null_block, new_state

    def lookup(
        self, seq: SeqState, request: SeqRequest, partials: bool, agreed: Agreed | None = None
    ) -> tuple[list[Hit], Partial | None]:
        """The new sequence's whole-block hits and, if `partials`, the partly matched block after them."""
        if agreed is not None:
            return agreed[request.seq_id], None
        return lookup(self.block_pool.prefix, seq, request.num_tokens, self.block_size, partials)

    def fit(self, new: Sequence[SeqRequest], agreed: Agreed | None = None) -> list[SeqRequest]:
        """Valid new requests, each with max_compute trimmed to its prefix hits plus max_compute tokens."""

        def cached(request: SeqRequest) -> int:
            hits, _ = self.lookup(self._new_state(request), request, False, agreed)
            return len(hits) * self.block_size

        ends = [min(r.num_tokens, cached(r) + r.max_compute) if r.max_compute else 0 for r in new]
        return [
            r._replace(num_tokens=end, token_ids=r.token_ids[:end]) if end else r
            for r, end in zip(new, ends, strict=True)
        ]

    def need(
        self, new: Sequence[SeqRequest], partials: bool, agreed: Agreed | None = None
    ) -> tuple[int, int]:
        """(blocks to take, evictable blocks the new sequences' prefix hits revive), with or without the
        copies of partly matched blocks."""
        need, revived = 0, set()
        for request in new:
            hits, part = self.lookup(self._new_state(request), request, partials, agreed)
            sources = [block_id for block_id, _ in hits if block_id != self._null_block]
            sources += [part[0]] if part else []
            revived.update(block_id for block_id in sources if self.block_pool.prefix.is_evictable(block_id))
            need += blocks_for(request.num_tokens, self.block_size) - len(hits)
        return need, len(revived)

    def admit(
        self,
        seqs: MutableMapping[str, SeqState],
        requests: Sequence[SeqRequest],
        use_partials: bool,
        agreed: Agreed | None,
    ) -> None:
        """Gives each request a table in `seqs`: its hits shared, then its blocks to num_tokens."""
        # NOTE: every hit is referenced before any table grows (theirs, or the running ones' next), so
        # growing never evicts a block still to hit.
        partials = {}
        for request in requests:
            seq = seqs[request.seq_id] = self._new_state(request)
            hits, part = self.lookup(seq, request, use_partials, agreed)
            self._tables.share(seq, hits, self._null_block)
            if part is not None:
                self.block_pool.reference(part[0])
                partials[request.seq_id] = part
            if seq.token_ids is not None:
                self._counters.prefix_query_tokens += request.num_tokens
                shared = [hit for hit in hits if hit[0] != self._null_block]
                for listener in self.block_pool.prefix.listeners:
                    listener.reused(shared)
        # NOTE: sharing what an earlier prompt of the call computes this step only lowers the blocks to take.
        step = StepBlocks(self.block_size)
        for request in requests:
            seq = seqs[request.seq_id]
            if agreed is None and self._tables.share(seq, step.match(seq, request.num_tokens)):
                part = partials.pop(request.seq_id, None)
                if part is not None:
                    self.block_pool.release(part[0])
            if request.seq_id in partials:
                self._tables.copy_partial(seq, *partials[request.seq_id])
            self._counters.prefix_hit_tokens += seq.cached_tokens
            self._tables.grow(seq, blocks_for(request.num_tokens, self.block_size) - len(seq.block_table))
            held = len(seq.block_table) - seq.block_table.count(self._null_block)
            self._counters.account(request.num_tokens, held)
            step.add(seq, request.num_tokens)
