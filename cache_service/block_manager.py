"""Block tables over one allocator: refcounts, prefix sharing, fork, copy-on-write and LRU eviction."""

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cache_service.allocators.base import BlockAllocator
from cache_service.block_pool import BlockPool
from cache_service.prefix_cache import BlockHash, block_hash, root_hash
from cache_service.sequence import SeqRequest, SeqState, check_request
from common.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted


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


@dataclass(frozen=True, slots=True)
class TableTail:
    """A block table from index `first` on; the entries before it are unchanged."""

    first: int
    block_ids: list[int]


class BlockManager:
    """One block table per sequence id; each batch call validates the whole batch before changing anything.

    Every block is free (in the allocator), used (refcount > 0) or cached (indexed, refcount 0, evictable).
    NOTE: `copy_block(src, dst)` copies a block's K/V; it runs inside `extend`, before compute writes.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        copy_block: Callable[[int, int], None] = lambda src, dst: None,
        prefix_caching: bool = True,
        model: str = "",
    ) -> None:
        assert block_size > 0, block_size
        self.allocator = allocator
        self.pool = BlockPool(allocator)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._copy_block = copy_block
        self._model = model
        self._seqs: dict[str, SeqState] = {}
        self._queried = self._hit = self._cow = 0
        # NOTE: Σ num_tokens and Σ table lengths over sequences, kept as tables change, never recounted.
        self._stored_tokens = self._table_blocks = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # allocate

    def can_allocate(self, requests: Sequence[SeqRequest]) -> bool:
        """Whether the new sequences fit; raises like `allocate` if invalid."""
        need, revived = self._check_allocate(requests)
        return need <= self.pool.num_available - revived

    def allocate(self, requests: Sequence[SeqRequest]) -> list[list[int]]:
        """Creates each new sequence's table, reusing the longest cached prefix (never the last token, whose
        logits are needed): whole blocks are shared, and a prefix that ends inside a block gets a copy of
        the cached block it matches; returns the tables in request order; all or nothing.

        Raises InvalidArgument (empty id, num_tokens <= 0, token_ids not num_tokens long), AlreadyExists
        (the sequence has a table or is listed twice) and ResourceExhausted (not enough blocks).
        """
        self._reserve(requests, ())
        return [self.block_table(request.seq_id) for request in requests]

    def reserve(self, new: Sequence[SeqRequest], running: Sequence[SeqRequest]) -> list[TableTail]:
        """One scheduler step: `allocate(new)` and `extend(running)` as one all-or-nothing call; returns what
        the caller lacks of each table, `new` then `running`: a new sequence's whole table, a running one's
        from the block holding its num_computed on (the only blocks this call can copy or add). Raises what
        either raises; nothing changes on an error."""
        self._reserve(new, running)
        tails = [TableTail(0, self.block_table(request.seq_id)) for request in new]
        for request in running:
            first = request.num_computed // self.block_size
            tails.append(TableTail(first, self._seqs[request.seq_id].block_table[first:]))
        return tails

    def _reserve(self, new: Sequence[SeqRequest], running: Sequence[SeqRequest]) -> None:
        grow = self._check_extend(running)
        # NOTE: copying a partly matched block pins it beside its copy; skipped when blocks are short.
        need, revived = self._check_allocate(new, partials=True)
        use_partials = need + grow <= self.pool.num_available - revived
        if not use_partials:
            need, revived = self._check_allocate(new, partials=False)
        self._ensure_available(need + grow, revived)
        # NOTE: the blocks the running sequences wrote last step are indexed before the new sequences look
        # the prefix cache up, so a prompt admitted now finds a shared prefix another prompt computed in the
        # step before (indexing only adds hits: the checks above over-count the blocks to take, never under).
        for request in running:
            seq = self._seqs[request.seq_id]
            self._register(seq, min(request.num_computed, seq.num_tokens))
        self._allocate(new, use_partials)
        self._extend(running)

    def _allocate(self, requests: Sequence[SeqRequest], use_partials: bool) -> None:
        # NOTE: every hit is referenced before any table grows (theirs, or those `reserve` extends next), so
        # growing never evicts a block still to hit.
        partials = {}
        for request in requests:
            seq = self._seqs[request.seq_id] = self._new_sequence(request)
            hits = self._lookup(request)
            for block_id, hash_ in hits:
                self.pool.reference(block_id)
                seq.block_table.append(block_id)
                seq.hashes.append(hash_)
            seq.cached_tokens = len(seq.block_table) * self.block_size
            partial = self._partial(request, hits) if use_partials else None
            if partial is not None:
                self.pool.reference(partial[0])
                partials[request.seq_id] = partial
            self._queried += request.num_tokens if seq.token_ids is not None else 0
        # NOTE: a prompt also shares the full blocks that a prompt before it in this call computes in the same
        # step (compute writes every new token's K/V of a layer before any attention reads the pool). They
        # are indexed only once their writer reports them written, so a failed step leaves no unwritten
        # block in the index; sharing only lowers the count of blocks to take.
        scheduled: dict[BlockHash, int] = {}
        for request in requests:
            seq = self._seqs[request.seq_id]
            if self._share_scheduled(request, seq, scheduled):
                partial = partials.pop(request.seq_id, None)
                if partial is not None:
                    self.pool.release(partial[0])
            if request.seq_id in partials:
                self._copy_partial(seq, *partials[request.seq_id])
            self._hit += seq.cached_tokens
            self._grow(seq, self.blocks_needed(request.num_tokens) - len(seq.block_table))
            self._account(request.num_tokens, len(seq.block_table))
            self._schedule(request, seq, scheduled)

    def _share_scheduled(self, request: SeqRequest, seq: SeqState, scheduled: dict[BlockHash, int]) -> int:
        """Extends the sequence's hits with blocks of `scheduled` (hash -> block an earlier prompt of the
        call computes this step); returns how many it took."""
        if not (scheduled and seq.token_ids is not None):
            return 0
        taken = 0
        for index in range(len(seq.hashes), (request.num_tokens - 1) // self.block_size):
            parent = seq.hashes[-1] if seq.hashes else seq.root
            hash_ = block_hash(parent, self._block_tokens(seq.token_ids, index))
            block_id = scheduled.get(hash_)
            if block_id is None:
                break
            self.pool.reference(block_id)
            seq.block_table.append(block_id)
            seq.hashes.append(hash_)
            taken += 1
        seq.cached_tokens += taken * self.block_size
        return taken

    def _schedule(self, request: SeqRequest, seq: SeqState, scheduled: dict[BlockHash, int]) -> None:
        """Adds the full blocks the sequence computes this step (past its hits) to `scheduled`."""
        if seq.token_ids is None:
            return
        parent = seq.hashes[-1] if seq.hashes else seq.root
        for index in range(len(seq.hashes), request.num_tokens // self.block_size):
            parent = block_hash(parent, self._block_tokens(seq.token_ids, index))
            scheduled.setdefault(parent, seq.block_table[index])

    def _new_sequence(self, request: SeqRequest) -> SeqState:
        tokens = list(request.token_ids) if self.prefix_caching and request.token_ids else None
        return SeqState(request.num_tokens, root_hash(self._model, request.cache_salt), tokens)

    def _lookup(self, request: SeqRequest) -> list[tuple[int, BlockHash]]:
        if not (self.prefix_caching and request.token_ids):
            return []
        hits, parent = [], root_hash(self._model, request.cache_salt)
        for index in range((request.num_tokens - 1) // self.block_size):
            parent = block_hash(parent, self._block_tokens(request.token_ids, index))
            block_id = self.pool.prefix.lookup(parent)
            if block_id is None:
                break
            hits.append((block_id, parent))
        return hits

    def _partial(self, request: SeqRequest, hits: list[tuple[int, BlockHash]]) -> tuple[int, int] | None:
        """(cached block, tokens it shares) for the block after the whole-block hits, if any."""
        if not (self.prefix_caching and request.token_ids):
            return None
        start = len(hits) * self.block_size
        limit = min(self.block_size, request.num_tokens - 1 - start)
        if limit <= 0:
            return None
        parent = hits[-1][1] if hits else root_hash(self._model, request.cache_salt)
        return self.pool.prefix.longest_partial(parent, request.token_ids[start : start + limit])

    def _copy_partial(self, seq: SeqState, source: int, shared: int) -> None:
        """The prefix ends `shared` tokens into `source`: the table gets a copy, since the rest is written."""
        (new,) = self.pool.take(1, seq.block_table)
        self._copy_block(source, new)
        seq.block_table.append(new)
        self.pool.release(source)
        seq.cached_tokens += shared
        self._cow += 1

    def _check_allocate(self, requests: Sequence[SeqRequest], partials: bool = False) -> tuple[int, int]:
        """(blocks to take, evictable blocks the batch's prefix hits revive), with or without the copies of
        partly matched blocks."""
        seen: set[str] = set()
        need, revived = 0, set()
        for request in requests:
            check_request(request)
            if request.seq_id in self._seqs:
                raise AlreadyExists(
                    f"sequence {request.seq_id!r} already has a block table: Extend or Free it"
                )
            if request.seq_id in seen:
                raise AlreadyExists(f"sequence {request.seq_id!r} is listed twice in one Allocate")
            if request.token_ids and len(request.token_ids) != request.num_tokens:
                raise InvalidArgument(
                    f"sequence {request.seq_id!r}: {len(request.token_ids)} token_ids for num_tokens "
                    f"{request.num_tokens}; give every token or none"
                )
            seen.add(request.seq_id)
            hits = self._lookup(request)
            partial = self._partial(request, hits) if partials else None
            sources = [block_id for block_id, _ in hits] + ([partial[0]] if partial else [])
            revived.update(block_id for block_id in sources if self.pool.prefix.is_evictable(block_id))
            need += self.blocks_needed(request.num_tokens) - len(hits)
        return need, len(revived)

    # extend

    def can_extend(self, requests: Sequence[SeqRequest]) -> bool:
        """Whether the growth and copies fit; raises like `extend` if invalid."""
        return self._check_extend(requests) <= self.pool.num_available

    def extend(self, requests: Sequence[SeqRequest]) -> list[list[int]]:
        """Records each sequence's new tokens and progress, indexes its newly written full blocks, copies the
        blocks the coming step writes that are shared or indexed (copy-on-write), grows the table to hold
        num_tokens, and returns the tables in request order; all or nothing.

        Raises NotFound (unknown sequence), InvalidArgument (bad counts or tokens, listed twice) and
        ResourceExhausted (not enough blocks).
        """
        self._reserve((), requests)
        return [self.block_table(request.seq_id) for request in requests]

    def _extend(self, requests: Sequence[SeqRequest]) -> None:
        for request in requests:
            seq = self._seqs[request.seq_id]
            self._account(
                request.num_tokens - seq.num_tokens,
                self.blocks_needed(request.num_tokens) - len(seq.block_table),
            )
            seq.num_tokens = request.num_tokens
            if seq.token_ids is not None:
                seq.token_ids.extend(request.token_ids)
            self._register(seq, request.num_computed)
            self._copy_on_write(seq, request.num_computed // self.block_size)
            self._grow(seq, self.blocks_needed(request.num_tokens) - len(seq.block_table))

    def _check_extend(self, requests: Sequence[SeqRequest]) -> int:
        for request in requests:
            check_request(request)
        self._check_known([request.seq_id for request in requests])
        seen: set[str] = set()
        need, copied = 0, Counter()
        for request in requests:
            if request.seq_id in seen:
                raise InvalidArgument(f"sequence {request.seq_id!r} is listed twice in one Extend")
            seen.add(request.seq_id)
            seq = self._seqs[request.seq_id]
            seq.check_extend(request, self.block_size)
            need += self.blocks_needed(request.num_tokens) - len(seq.block_table)
            for block_id in seq.block_table[request.num_computed // self.block_size :]:
                if self.pool.must_copy(block_id, copied[block_id]):
                    need += 1
                    copied[block_id] += 1
        return need

    # fork

    def fork(self, parent_id: str, child_ids: Sequence[str]) -> list[list[int]]:
        """Gives each child a table sharing every block of the parent (and its tokens); returns the tables.

        Raises NotFound (unknown parent), InvalidArgument (empty or repeated child id) and AlreadyExists
        (a child has a table); on any error nothing changed.
        """
        self._check_known([parent_id])
        if len(set(child_ids)) != len(child_ids) or not all(child_ids):
            raise InvalidArgument(f"child ids must be distinct and non-empty, got {list(child_ids)}")
        taken = sorted(child_id for child_id in child_ids if child_id in self._seqs)
        if taken:
            raise AlreadyExists(f"sequences {taken} already have block tables")
        parent = self._seqs[parent_id]
        for child_id in child_ids:
            tokens = list(parent.token_ids) if parent.token_ids is not None else None
            self._seqs[child_id] = SeqState(
                parent.num_tokens, parent.root, tokens, list(parent.block_table), list(parent.hashes)
            )
            for block_id in parent.block_table:
                self.pool.reference(block_id)
            self._account(parent.num_tokens, len(parent.block_table))
        return [self.block_table(child_id) for child_id in child_ids]

    # free

    def free(self, seq_ids: Sequence[str], num_computed: Mapping[str, int] | None = None) -> int:
        """Drops the sequences' tables and returns how many blocks left use; all or nothing.

        num_computed (optional, per sequence): its leading tokens whose K/V is written, so that its full
        blocks stay in the prefix cache. Raises NotFound (unknown sequence) and InvalidArgument (listed
        twice, bad num_computed); on any error nothing changed.
        """
        num_computed = num_computed or {}
        self._check_known([*seq_ids, *num_computed])
        twice = sorted(seq_id for seq_id, count in Counter(seq_ids).items() if count > 1)
        if twice or set(num_computed) - set(seq_ids):
            raise InvalidArgument(f"sequences {twice} are listed twice in one Free, or not freed")
        for seq_id, computed in num_computed.items():
            seq = self._seqs[seq_id]
            if not 0 <= computed <= seq.num_tokens:
                raise InvalidArgument(f"sequence {seq_id!r}: num_computed {computed} is out of range")
        released = 0
        for seq_id in seq_ids:
            seq = self._seqs.pop(seq_id)
            self._account(-seq.num_tokens, -len(seq.block_table))
            self._register(seq, num_computed.get(seq_id, 0))
            # NOTE: tail blocks first, so they are evicted before the prefix blocks others may share.
            released += sum(self.pool.release(block_id) for block_id in reversed(seq.block_table))
        return released

    # queries

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of the sequence's block table; NotFound if the sequence has none."""
        self._check_known([seq_id])
        return list(self._seqs[seq_id].block_table)

    def cached_tokens(self, seq_id: str) -> int:
        """Leading tokens whose K/V `allocate` found in the prefix cache."""
        self._check_known([seq_id])
        return self._seqs[seq_id].cached_tokens

    def refcount(self, block_id: int) -> int:
        """How many block tables hold the block; InvalidArgument if it is out of range."""
        if not 0 <= block_id < self.allocator.num_total:
            raise InvalidArgument(
                f"block {block_id} does not exist: the pool has {self.allocator.num_total} blocks"
            )
        return self.pool.refcounts[block_id]

    def stats(self) -> BlockStats:
        free, total, cached = self.allocator.num_free, self.pool.num_total, self.pool.prefix.num_evictable
        return BlockStats(
            total, total - free - cached, free, cached, len(self._seqs), self.block_size,
            self._queried, self._hit, self._cow, self.pool.prefix.num_evictions,
            self._stored_tokens, self._table_blocks * self.block_size,
        )  # fmt: skip

    def check_invariants(self) -> None:
        """Asserts: refcount == tables holding the block; free + used + cached == total, disjoint; no table
        holds a block twice or lacks blocks for its tokens; indexed blocks hold the tokens of their hash."""
        holders = [0] * self.pool.num_total
        assert self._stored_tokens == sum(seq.num_tokens for seq in self._seqs.values()), self._stored_tokens
        assert self._table_blocks == sum(len(seq.block_table) for seq in self._seqs.values()), (
            self._table_blocks
        )
        for seq_id, seq in self._seqs.items():
            table = seq.block_table
            assert len(set(table)) == len(table), f"sequence {seq_id!r} holds a block twice: {table}"
            assert len(table) == self.blocks_needed(seq.num_tokens), (seq_id, seq.num_tokens, table)
            assert seq.token_ids is None or len(seq.token_ids) == seq.num_tokens, seq_id
            for index, block_id in enumerate(table):
                holders[block_id] += 1
                if self.pool.prefix.is_indexed(block_id):
                    claimed = self.pool.prefix.tokens(block_id)
                    assert claimed == tuple(self._block_tokens(seq.token_ids, index)), block_id
        self.pool.check_invariants(holders)

    # helpers

    def _block_tokens(self, tokens: Sequence[int], index: int) -> Sequence[int]:
        return tokens[index * self.block_size : (index + 1) * self.block_size]

    def _register(self, seq: SeqState, num_computed: int) -> None:
        """Indexes the sequence's full blocks whose K/V is now written."""
        if seq.token_ids is None:
            return
        for index in range(len(seq.hashes), num_computed // self.block_size):
            parent = seq.hashes[-1] if seq.hashes else seq.root
            seq.hashes.append(
                self.pool.register(seq.block_table[index], parent, self._block_tokens(seq.token_ids, index))
            )

    def _copy_on_write(self, seq: SeqState, first_written: int) -> None:
        for index in range(first_written, len(seq.block_table)):
            old = seq.block_table[index]
            if self.pool.must_copy(old):
                (new,) = self.pool.take(1, seq.block_table[:index])
                self._copy_block(old, new)
                seq.block_table[index] = new
                self.pool.release(old)
                self._cow += 1

    def _account(self, tokens: int, blocks: int) -> None:
        self._stored_tokens += tokens
        self._table_blocks += blocks

    def _grow(self, seq: SeqState, n: int) -> None:
        assert n >= 0, n
        seq.block_table.extend(self.pool.take(n, seq.block_table))

    def _check_known(self, seq_ids: Sequence[str]) -> None:
        unknown = sorted({seq_id for seq_id in seq_ids if seq_id not in self._seqs})
        if unknown:
            raise NotFound(f"unknown sequences {unknown}: Allocate them first (or they were freed)")

    def _ensure_available(self, need: int, revived: int) -> None:
        available, total = self.pool.num_available - revived, self.pool.num_total
        if need > available:
            raise ResourceExhausted(
                f"need {need} blocks, {available} free of {total} (block_size {self.block_size}): "
                "free or preempt sequences, or give the pool more memory"
            )
