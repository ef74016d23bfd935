"""The gateway's one view of the cache service: the blocks a reservation can take, each sequence's block
table and how much of it the cache service knows, and the Reserve, Fork and Free calls that change them.
The scheduler asks it questions; only its own calls write it."""

import time
from collections.abc import Sequence as Seqs
from dataclasses import dataclass, field

import grpc
import structlog

from common.kv_groups import window_blocks
from common.paging import blocks_for
from common.server import request_metadata
from gateway.lease import Lease
from gateway.sequence import PrefixHit, Sequence
from protos import cache_pb2, cache_pb2_grpc

log = structlog.get_logger()


@dataclass(slots=True)
class SeqBlocks:
    """What the cache service holds for one sequence, as the gateway knows it."""

    block_table: list[int] = field(default_factory=list)
    # A pool of several KV groups: the tables of groups 1.. (block_table is group 0's).
    group_tables: list[list[int]] = field(default_factory=list)
    # Tokens the cache service holds (the rest go with the next Reserve).
    num_synced: int = 0
    # Forked and not reserved since: the next write may copy a shared block, which takes one more block.
    shares_tail: bool = False


class KVView:
    """Mirrors the cache service from its replies only: `available_blocks` (free plus evictable) is set
    from every reply, tables grow from Reserve's table tails.

    A sequence without a table starts at the prefix a Lookup found cached (`Sequence.chunk_start`): its
    first chunk is sized by the tokens left to compute, and its Reserve caps the tokens computed after the
    hits (max_compute_tokens), so a stale answer costs neither budget nor blocks.

    A new sequence's prefix hits (the Lookup's `prefix_hit.blocks`) count as blocks of its table: they take no
    new block. One that no table holds is cached (evictable) and counted in `available_blocks`: taking it
    costs one of them, which the scheduler counts (`held_blocks`).
    NOTE: a hint may be stale; the Reserve's max_compute_tokens keeps the new blocks of a table as planned,
    and a Reserve refused all the same undoes the admissions (gateway.reservation).

    On a pool of several KV groups (`windows`: each group's, 0 for full attention) a sequence holds a table
    in each, all of one length (a sliding group's released entries name the null block): a step takes a
    block per group for each block a table lacks (the cache releases a sliding group's old blocks after
    growing it; the replies' available_blocks count what it gave back), and a sliding group's table holds
    at most its window's blocks plus one once the sequence decodes (`blocks_to_hold`).
    """

    def __init__(
        self,
        stub: cache_pb2_grpc.CacheStub,
        block_size: int,
        num_blocks: int,
        rpc_timeout_s: float = 120.0,
        lease: Lease | None = None,
        windows: tuple[int, ...] = (0,),
    ) -> None:
        self.block_size = block_size
        self.windows = windows
        self._lease = lease
        self.num_blocks = num_blocks
        self.available_blocks = num_blocks
        self._stub = stub
        self._timeout = rpc_timeout_s
        self._seqs: dict[str, SeqBlocks] = {}

    # questions

    def holds(self, seq: Sequence) -> bool:
        """Whether the cache service holds a block table for the sequence."""
        return seq.seq_id in self._seqs

    def block_table(self, seq: Sequence) -> list[int]:
        """The sequence's block table (empty if it holds none); read only."""
        kv = self._seqs.get(seq.seq_id)
        return kv.block_table if kv else []

    def tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's table in each KV group (none if it holds none); read only."""
        kv = self._seqs.get(seq.seq_id)
        return [kv.block_table, *kv.group_tables] if kv else []

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def step_tables(self, seqs: Seqs[Sequence]) -> list[list[list[int]]]:
        """Per KV group, the sequences' tables (read only): what a Forward of them sends."""
        kvs = [self._seqs[seq.seq_id] for seq in seqs]
        return [[kv.block_table for kv in kvs]] + [
            [kv.group_tables[group] for kv in kvs] for group in range(self.num_groups - 1)
        ]

    def blocks_needed(self, seq: Sequence, end: int) -> int:
        """Blocks the sequence lacks to hold `end` tokens (plus one to copy a shared block into), in every
        KV group; a new one's prefix hits are not among them."""
        shares_tail = self._seqs[seq.seq_id].shares_tail if seq.seq_id in self._seqs else False
        lacks = max(0, blocks_for(end, self.block_size) - self._table_len(seq)) + shares_tail
        return lacks * self.num_groups

    def blocks_to_hold(self, seq: Sequence, end: int) -> int:
        """Blocks the sequence lacks to hold `end` tokens once it decodes there: `blocks_needed`, a sliding
        group's capped at the most its table holds (common.kv_groups.window_blocks)."""
        lacks = self.blocks_needed(seq, end) // self.num_groups
        caps = [window_blocks(window, self.block_size) if window else lacks for window in self.windows]
        return sum(min(lacks, cap) for cap in caps)

    def room(self, seq: Sequence, free: int) -> int:
        """Tokens past its chunk_start the sequence can hold if it takes up to `free` more blocks (in every
        KV group: each group's table grows by a block per block_size tokens)."""
        shares_tail = self._seqs[seq.seq_id].shares_tail if seq.seq_id in self._seqs else False
        per_group = free // self.num_groups
        return (self._table_len(seq) + per_group - shares_tail) * self.block_size - seq.chunk_start

    def held_blocks(self) -> set[int]:
        """Every block some table of the view holds: a prefix hit on one of them takes no block."""
        return {
            block_id
            for kv in self._seqs.values()
            for table in (kv.block_table, *kv.group_tables)
            for block_id in table
        }

    def _table_len(self, seq: Sequence) -> int:
        """Blocks of its table: those it holds, or without a table its prefix hits (the Lookup's)."""
        kv = self._seqs.get(seq.seq_id)
        if kv is not None:
            return len(kv.block_table)
        return len(seq.prefix_hit.blocks) if seq.prefix_hit is not None else 0

    # calls

    def lookup(self, seqs: Seqs[Sequence], running: Seqs[Sequence] = ()) -> None:
        """Sets each sequence's prefix_hit: the leading tokens the cache holds computed of it (a KV tier's
        blocks loaded into the pool first; none, unasked, for one kept out of the prefix cache), and their
        blocks. The running sequences' progress goes along, so their last step's blocks are found too."""
        for seq in [seq for seq in seqs if not seq.prefix_cached]:
            seq.prefix_hit = PrefixHit(0)
        if not (seqs := [seq for seq in seqs if seq.prefix_cached]):
            return
        held = [seq for seq in running if self.holds(seq)]
        progress = {s.seq_id: min(s.num_computed, self._seqs[s.seq_id].num_synced) for s in held}
        request = cache_pb2.LookupRequest(
            seqs=[_seq_request(seq, seq.cache_token_ids, seq.num_tokens) for seq in seqs],
            num_computed=progress,
            session_id=self._session_id if progress else "",
        )
        reply = self._stub.Lookup(request, timeout=self._timeout, metadata=_ids(seqs))
        # NOTE: a cache that sends no prefix_blocks has its hits counted as new blocks (an upper bound).
        blocks = [tuple(p.block_ids) for p in reply.prefix_blocks] or [()] * len(seqs)
        for seq, cached, block_ids in zip(seqs, reply.cached_tokens, blocks, strict=True):
            seq.prefix_hit = PrefixHit(cached, block_ids)
        self.available_blocks = reply.available_blocks

    def covers(self, seqs: Seqs[Sequence], lookahead: int = 0) -> bool:
        """Whether the step needs no Reserve: every sequence has a table whose blocks hold its chunk (and
        its lookahead: see `reserve`) and that it alone holds (no fork since its last Reserve), so nothing is
        to be grown or copied."""
        for seq in seqs:
            kv = self._seqs.get(seq.seq_id)
            end = seq.chunk_end + seq.lookahead(lookahead + 1)
            if kv is None or kv.shares_tail or end > len(kv.block_table) * self.block_size:
                return False
        return True

    def reserve(self, seqs: Seqs[Sequence], lookahead: int = 0) -> None:
        """One Reserve for a step, unless the tables cover it (`covers`): then nothing is sent, and the
        new tokens and progress go with the next Reserve (NOTE: a decode then calls the cache once per
        block; the prefix cache learns its written blocks that much later). Otherwise: a table for each
        sequence the cache holds none for (its prefix hits plus at most the chunk's tokens after its
        `start`), and for every other one its new tokens and progress, its table grown to hold its chunk
        (the reply carries only the part of a table that may change).

        Prefix hits move num_computed on (a new table's hits set cached_prefix), and a new table's size sets
        chunk_end; a sequence's first reservation sets scheduled_at and cached_tokens and drops its
        prefix_hit. `lookahead` (running
        sequences only): the tables also hold that many slots after the chunk, for the later steps of a
        multi-step call, each at most one per token the sequence may still sample after the chunk's
        (Sequence.lookahead: slots no step can write would only evict cached prefixes).
        """
        if self.covers(seqs, lookahead):
            return
        now = time.monotonic()
        new = [seq for seq in seqs if seq.seq_id not in self._seqs]
        running = [seq for seq in seqs if seq.seq_id in self._seqs]
        new_ids = {seq.seq_id for seq in new}
        request = cache_pb2.ReserveRequest(
            new_seqs=[self._new_request(seq) for seq in new],
            running_seqs=[self._running_request(seq, lookahead) for seq in running],
            session_id=self._session_id,
        )
        reply = self._stub.Reserve(request, timeout=self._timeout, metadata=_ids(seqs))
        for seq, table in zip((*new, *running), reply.tables, strict=True):
            assert seq.seq_id == table.seq_id, (seq.seq_id, table.seq_id)
            kv = self._seqs.setdefault(seq.seq_id, SeqBlocks())
            assert table.first_block <= len(kv.block_table), (seq.seq_id, table.first_block)
            kv.block_table[table.first_block :] = table.block_ids
            kv.group_tables = kv.group_tables or [[] for _ in table.groups]
            for held, group in zip(kv.group_tables, table.groups, strict=True):
                held[group.first_block :] = group.block_ids
            seq.chunk_end = table.num_tokens or seq.chunk_end
            kv.num_synced, kv.shares_tail = seq.chunk_end, False
            seq.num_computed = max(seq.num_computed, table.cached_tokens)
            seq.cached_prefix = seq.cached_prefix or (seq.seq_id in new_ids and table.cached_tokens > 0)
            seq.prefix_hit = None  # the table holds the hits now
            if seq.scheduled_at is None:
                seq.scheduled_at, seq.cached_tokens = now, table.cached_tokens
        self.available_blocks = reply.available_blocks

    def _new_request(self, seq: Sequence) -> cache_pb2.SequenceRequest:
        """Its tokens up to chunk_end (none if kept out of the prefix cache); the step computes at most
        chunk_end - chunk_start after the hits."""
        tokens = seq.cache_token_ids[: seq.chunk_end] if seq.prefix_cached else []
        return _seq_request(seq, tokens, seq.chunk_end, max_compute=seq.chunk_end - seq.chunk_start)

    def _running_request(self, seq: Sequence, lookahead: int) -> cache_pb2.SequenceRequest:
        """The tokens appended since the previous Reserve, and its progress."""
        request = _seq_request(
            seq, seq.cache_token_ids[self._seqs[seq.seq_id].num_synced : seq.chunk_end], seq.chunk_end
        )
        request.lookahead_tokens = seq.lookahead(lookahead + 1)
        return request

    def fork(self, parent: Sequence, children: Seqs[Sequence]) -> None:
        """The children get tables sharing every block of the parent, which holds its whole sequence; the
        next write of each of them (and of the parent) copies the shared block it writes into."""
        request = cache_pb2.ForkRequest(
            parent_id=parent.seq_id, child_ids=[c.seq_id for c in children], session_id=self._session_id
        )
        reply = self._stub.Fork(request, timeout=self._timeout, metadata=_ids([parent]))
        self._seqs[parent.seq_id].shares_tail = True
        for child, table in zip(children, reply.tables, strict=True):
            assert child.seq_id == table.seq_id, (child.seq_id, table.seq_id)
            groups = [list(group.block_ids) for group in table.groups]
            self._seqs[child.seq_id] = SeqBlocks(list(table.block_ids), groups, parent.num_tokens, True)
        self.available_blocks = reply.available_blocks

    def free(self, seqs: Seqs[Sequence]) -> None:
        """Releases the sequences' blocks (their written full blocks stay in the prefix cache, the tokens the
        cache does not hold yet sent along) and forgets them; they keep their tokens, and their progress
        starts again from 0."""
        request = cache_pb2.FreeRequest(
            seq_ids=[s.seq_id for s in seqs],
            num_computed={s.seq_id: s.num_computed for s in seqs},
            session_id=self._session_id,
        )
        # NOTE: tokens written since the last Reserve (a multi-step's) go along: their full blocks indexed.
        for seq in seqs:
            synced = self._seqs[seq.seq_id].num_synced
            if synced < seq.num_computed:
                appended = request.appended_token_ids[seq.seq_id].token_ids
                appended.extend(seq.cache_token_ids[synced : seq.num_computed])
        reply = self._stub.Free(request, timeout=self._timeout, metadata=_ids(seqs))
        self.available_blocks = reply.available_blocks
        self.forget(seqs)

    def reset(self, num_blocks: int, windows: tuple[int, ...] = (0,)) -> None:
        """For a newly attached pool (its size and KV groups may differ): every table forgotten, every block
        available."""
        assert not self._seqs, f"{len(self._seqs)} sequences still held: free or forget them first"
        self.num_blocks = self.available_blocks = num_blocks
        self.windows = windows

    def reattach(
        self, held: Seqs[Sequence], num_blocks: int, same_pool: bool, windows: tuple[int, ...] = (0,)
    ) -> None:
        """After a new handshake: the sequences the view holds are freed in the cache if it kept its pool,
        else forgotten; then the view starts afresh on a pool of `num_blocks` in KV groups of `windows`."""
        # NOTE: num_computed counts only steps that completed, so the blocks it keeps cached were written.
        (self.release if same_pool else self.forget)(held)
        self.reset(num_blocks, windows)

    def release(self, seqs: Seqs[Sequence]) -> None:
        """For sequences that ended: frees those the cache holds. A failed Free is logged and they are
        forgotten all the same (nothing will run them again)."""
        held = [seq for seq in seqs if seq.seq_id in self._seqs]
        if not held:
            return
        try:
            self.free(held)
        except grpc.RpcError as err:
            log.error("free_failed", seq_ids=[s.seq_id for s in held], error=err.details())
            self.forget(held)

    @property
    def _session_id(self) -> str:
        """The session the calls name (the lease's current one; none without a lease)."""
        return self._lease.session_id if self._lease else ""

    def forget(self, seqs: Seqs[Sequence]) -> None:
        """Drops the sequences' tables from the view without a call (the cache lost them, or will)."""
        for seq in seqs:
            del self._seqs[seq.seq_id]
            seq.drop_kv()


def _ids(seqs: Seqs[Sequence]) -> tuple[tuple[str, str], ...]:
    return request_metadata(seq.request_id for seq in seqs)


def _seq_request(
    seq: Sequence, new_tokens: list[int], num_tokens: int, max_compute: int = 0
) -> cache_pb2.SequenceRequest:
    return cache_pb2.SequenceRequest(
        seq_id=seq.seq_id,
        num_tokens=num_tokens,
        token_ids=new_tokens,
        num_computed=seq.num_computed,
        cache_salt=seq.cache_salt,
        max_compute_tokens=max_compute,
        lora_id=seq.lora_id,
        lora_name=seq.lora_name,
    )
