"""Block tables over one block pool: a step's Reserve (prefix hits, copy-on-write, growth), fork, free."""

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from cache_service.admission import Admission, Agreed
from cache_service.allocators.base import BlockAllocator
from cache_service.block_pool import BlockPool, Parting
from cache_service.invariants import table_holders
from cache_service.prefix_cache import root_hash
from cache_service.prefix_match import Candidate, candidates
from cache_service.sequence import (
    SeqRequest,
    SeqState,
    TableTail,
    check_fork,
    check_free,
    check_known,
    check_new,
    check_progress,
    check_running,
)
from cache_service.stats import BlockStats, Counters
from cache_service.tables import Tables
from common.kv_groups import KVGroup
from common.paging import blocks_for


class BlockManager:
    """One block table per sequence id; each call validates the whole batch before changing anything.

    Every block is free (in the allocator), used (refcount > 0) or cached (indexed, refcount 0, evictable).
    NOTE: `copy_block(src, dst)` copies a block's K/V; it runs inside `reserve`, before compute writes.
    What changes one table (hits shared, blocks indexed, copied on write, grown) is cache_service.tables.
    A manager of one KV group (common/kv_groups.py) may share `block_pool` and `null_block` with the other
    groups' managers (cache_service/hybrid_blocks.py); a sliding group's tables release the blocks out of
    the window of the step's first query, their entries then holding `null_block` (a block no kernel reads:
    the window masks it).
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        copy_block: Callable[[int, int], None] = lambda src, dst: None,
        prefix_caching: bool = True,
        model: str = "",
        group: KVGroup | None = None,
        block_pool: BlockPool | None = None,
        null_block: int = -1,
    ) -> None:
        assert block_size > 0, block_size
        self.allocator = allocator
        self.block_pool = block_pool or BlockPool(allocator)
        self.block_size = block_size
        self.group = group
        # NOTE: a sliding group's manager alone in its pool holds the null block itself, for good.
        self._owns_null = group is not None and bool(group.window) and null_block < 0
        self.null_block = self.block_pool.take(1, []).pop() if self._owns_null else null_block
        self.prefix_caching = prefix_caching
        self._model = model
        self._seqs: dict[str, SeqState] = {}
        self._counters = Counters()
        self._tables = Tables(self.block_pool, block_size, copy_block, self._counters)
        self._admission = Admission(
            self.block_pool, block_size, self._tables, self._counters, self.null_block, self._new_state
        )

    @property
    def num_available(self) -> int:
        """Blocks a reservation can take: free plus cached (evictable)."""
        return self.block_pool.num_available

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # reserve

    def can_reserve(self, new: Sequence[SeqRequest], running: Sequence[SeqRequest]) -> bool:
        """Whether the step fits (without copying partly matched blocks); raises like `reserve` if invalid."""
        self.check(new, running)
        need, revived = self._admission.need(new, partials=False)
        return need + self._growth(running) <= self.num_available - revived

    def reserve(
        self,
        new: Sequence[SeqRequest],
        running: Sequence[SeqRequest],
        hits: Agreed | None = None,
    ) -> list[TableTail]:
        """One scheduler step, all or nothing. `new` sequences get tables reusing the longest computed prefix
        (never the last token, whose logits are needed): whole blocks are shared, and a prefix that ends
        inside a block gets a copy of the cached block it matches. `running` ones record their new tokens
        and progress, index their newly written full blocks, copy the blocks the step writes that are shared
        or indexed (copy-on-write) and grow to hold num_tokens plus lookahead (a table never shrinks).

        A new sequence with max_compute holds its prefix hits plus at most that many tokens (`fit`).
        `hits` (per new sequence, as cache_service.hybrid_blocks agrees them over every KV group): the prefix
        hits to share instead of this table's own lookup, with no partly matched block and no block another
        prompt of the call computes.
        Returns what the caller lacks of each table, `new` then `running`: a new sequence's whole table (and
        its num_tokens), a running one's from the block holding its num_computed on (the only blocks this
        call can copy or add).
        Raises InvalidArgument (bad counts or tokens), AlreadyExists (a new sequence has a table or is listed
        twice), NotFound (a running one has none) and ResourceExhausted (not enough blocks).
        """
        self.check(new, running)
        new = self._admission.fit(new, hits)
        grow = self._growth(running)
        # NOTE: copying a partly matched block pins it beside its copy; skipped when blocks are short.
        need, revived = self._admission.need(new, hits is None, hits)
        use_partials = hits is None and need + grow <= self.num_available - revived
        if not use_partials and hits is None:
            need, revived = self._admission.need(new, False)
        self.block_pool.ensure_available(need + grow, revived, self.block_size)
        # NOTE: the blocks the running sequences wrote last step are indexed before the new sequences look
        # the prefix cache up, so a prompt admitted now finds a shared prefix another prompt computed in the
        # step before (indexing only adds hits: the counts above over-count the blocks to take, never under).
        self.index_written({r.seq_id: r.num_computed for r in running})
        self._admission.admit(self._seqs, new, use_partials, hits)
        self._grow_running(running)
        self._release_out_of_window(new, running)
        tails = [
            TableTail(0, self.block_table(r.seq_id), self.cached_tokens(r.seq_id), r.num_tokens) for r in new
        ]
        for request in running:
            first = request.num_computed // self.block_size
            tails.append(TableTail(first, self._seqs[request.seq_id].block_table[first:]))
        return tails

    def step_need(
        self,
        new: Sequence[SeqRequest],
        running: Sequence[SeqRequest],
        hits: Agreed | None = None,
    ) -> int:
        """Blocks a valid `reserve(new, running, hits)` needs available (without copying partly matched
        blocks), the evictable ones its prefix hits revive included; an upper bound once a sliding table
        releases."""
        need, revived = self._admission.need(self._admission.fit(new, hits), False, hits)
        return need + revived + self._growth(running)

    def check(self, new: Sequence[SeqRequest], running: Sequence[SeqRequest]) -> None:
        """Raises as `reserve` does when the batch is invalid (before blocks are counted); changes nothing."""
        check_running(running, self._seqs, self.block_size)
        check_new(new, self._seqs)

    def cached_prefix(self, request: SeqRequest) -> int:
        """Leading tokens of a valid new request found computed in whole indexed blocks (never the last)."""
        return len(self.prefix_blocks(request)) * self.block_size

    def prefix_blocks(self, request: SeqRequest) -> list[int]:
        """The indexed blocks holding `cached_prefix(request)`, in order."""
        hits, _ = self._admission.lookup(self._new_state(request), request, False)
        return [block_id for block_id, _ in hits]

    def hit_candidates(self, request: SeqRequest) -> list[Candidate]:
        """Every full block of a valid new request before its last token's: (indexed block or None, hash)."""
        return candidates(
            self.block_pool.prefix, self._new_state(request), request.num_tokens, self.block_size
        )

    def index_written(self, num_computed: Mapping[str, int]) -> None:
        """Indexes the full blocks of each sequence's first num_computed tokens (K/V written; at most its
        tokens). Raises NotFound (no table) and InvalidArgument (negative); on error nothing changed."""
        check_progress(num_computed, self._seqs)
        for seq_id, computed in num_computed.items():
            seq = self._seqs[seq_id]
            self._tables.register(seq, min(computed, seq.num_tokens))

    def _growth(self, running: Sequence[SeqRequest]) -> int:
        """Blocks the running sequences take: growth, and a copy of each shared block the step writes."""
        need, copied = 0, Counter()
        for request in running:
            seq = self._seqs[request.seq_id]
            need += seq.growth(request, self.block_size)
            for block_id in seq.block_table[request.num_computed // self.block_size :]:
                if self.block_pool.must_copy(block_id, copied[block_id]):
                    need += 1
                    copied[block_id] += 1
        return need

    def _release_out_of_window(self, new: Sequence[SeqRequest], running: Sequence[SeqRequest]) -> None:
        if self.group is None or not self.group.window:
            return
        firsts = [(r.seq_id, self._seqs[r.seq_id].cached_tokens) for r in new]
        for seq_id, first_written in firsts + [(r.seq_id, r.num_computed) for r in running]:
            seq = self._seqs[seq_id]
            first_kept = self.group.first_kept(first_written, self.block_size)
            released = self._tables.release(seq, first_kept, self.null_block)
            self._counters.account(0, -released)

    def _grow_running(self, requests: Sequence[SeqRequest]) -> None:
        for request in requests:
            seq = self._seqs[request.seq_id]
            grow = seq.growth(request, self.block_size)
            self._counters.account(request.num_tokens - seq.num_tokens, grow)
            seq.num_tokens = request.num_tokens
            if seq.token_ids is not None:
                seq.token_ids.extend(request.token_ids)
            self._tables.register(seq, request.num_computed)
            self._tables.copy_on_write(seq, request.num_computed // self.block_size)
            self._tables.grow(seq, grow)

    # fork

    def fork(self, parent_id: str, child_ids: Sequence[str]) -> list[list[int]]:
        """Gives each child a table sharing the parent's blocks of its tokens (not its lookahead blocks,
        which hold nothing yet) and its tokens; returns the tables.

        Raises NotFound (unknown parent), InvalidArgument (empty or repeated child id) and AlreadyExists
        (a child has a table); on any error nothing changed.
        """
        check_fork(parent_id, child_ids, self._seqs)
        parent = self._seqs[parent_id]
        shared = parent.block_table[: self.blocks_needed(parent.num_tokens)]
        held = [block_id for block_id in shared if block_id != self.null_block]
        for child_id in child_ids:
            tokens = list(parent.token_ids) if parent.token_ids is not None else None
            self._seqs[child_id] = SeqState(
                parent.num_tokens, parent.root, tokens, list(shared), list(parent.hashes), lora=parent.lora
            )
            for block_id in held:
                self.block_pool.reference(block_id)
            self._counters.account(parent.num_tokens, len(held))
        return [self.block_table(child_id) for child_id in child_ids]

    # free

    def free(
        self,
        seq_ids: Sequence[str],
        num_computed: Mapping[str, int] | None = None,
        appended: Mapping[str, Sequence[int]] | None = None,
    ) -> int:
        """Drops the sequences' tables and returns how many blocks left use; all or nothing.

        num_computed (optional, per sequence): its leading tokens whose K/V is written, so that its full
        blocks stay in the prefix cache; appended (optional, per sequence): tokens it gained since its last
        Reserve, within its table, which num_computed may cover. Raises NotFound (unknown sequence) and
        InvalidArgument (listed twice, bad num_computed, appended tokens beyond the table); on any error
        nothing changed.
        """
        return sum(
            self.block_pool.let_go(*entry)
            for parting in self.detach(seq_ids, num_computed, appended)
            for entry in reversed(parting)
            if entry is not None
        )

    def detach(
        self,
        seq_ids: Sequence[str],
        num_computed: Mapping[str, int] | None = None,
        appended: Mapping[str, Sequence[int]] | None = None,
    ) -> list[list[Parting | None]]:
        """`free` up to letting the blocks go: drops the tables (all or nothing, raising as `free` does) and
        indexes their written blocks; returns per sequence, per table index, the block to let go
        (BlockPool.let_go) or None. The caller lets them go tail first, so a prompt's last blocks are
        evicted before the prefix blocks others may share; a sliding window's released entries name the
        block the index still keeps for them, so it ranks by its position, not by when the window passed."""
        num_computed, appended = num_computed or {}, appended or {}
        check_free(seq_ids, num_computed, self._seqs, appended, self.block_size)
        partings = []
        for seq_id in seq_ids:
            seq = self._seqs.pop(seq_id)
            held = [block_id for block_id in seq.block_table if block_id != self.null_block]
            self._counters.account(-seq.num_tokens, -len(held))
            seq.append(appended.get(seq_id, ()))
            self._tables.register(seq, num_computed.get(seq_id, 0))
            partings.append([self._parting(seq, index) for index in range(len(seq.block_table))])
        return partings

    def _parting(self, seq: SeqState, index: int) -> Parting | None:
        block_id = seq.block_table[index]
        if block_id != self.null_block:
            return block_id, True
        kept = self.block_pool.prefix.lookup(seq.hashes[index]) if index < len(seq.hashes) else None
        return None if kept is None else (kept, False)

    # queries

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of the sequence's block table; NotFound if the sequence has none."""
        check_known([seq_id], self._seqs)
        return list(self._seqs[seq_id].block_table)

    def cached_tokens(self, seq_id: str) -> int:
        """Leading tokens whose K/V the sequence's admission found computed."""
        check_known([seq_id], self._seqs)
        return self._seqs[seq_id].cached_tokens

    def refcount(self, block_id: int) -> int:
        """How many block tables hold the block; InvalidArgument if it is out of range."""
        return self.block_pool.refcount(block_id)

    def stats(self) -> BlockStats:
        return self._counters.snapshot(self.block_pool, len(self._seqs), self.block_size)

    def check_invariants(self) -> None:
        """Asserts the tables' and the pool's invariants (cache_service.invariants)."""
        holders = self.holders()
        if self._owns_null:
            holders[self.null_block] += 1
        self.block_pool.check_invariants(holders)

    def holders(self) -> list[int]:
        """Per block, how many of this manager's table entries hold it (cache_service.invariants)."""
        return table_holders(self._seqs, self._counters, self.block_pool, self.block_size, self.null_block)

    def _new_state(self, request: SeqRequest) -> SeqState:
        tokens = list(request.token_ids) if self.prefix_caching and request.token_ids else None
        lora = (request.lora_id, request.lora_name) if request.lora_id else None
        root = root_hash(self._model, request.cache_salt, request.adapter)
        return SeqState(request.num_tokens, root, tokens, lora=lora)
