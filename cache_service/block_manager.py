"""Block tables of sequences over one allocator, with a refcount per physical block."""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cache_service.allocators.base import BlockAllocator
from common.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted


class SeqRequest(NamedTuple):
    """A sequence and the number of tokens it must be able to hold after the call."""

    seq_id: str
    num_tokens: int


@dataclass(slots=True)
class _Sequence:
    num_tokens: int
    block_table: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class BlockStats:
    total_blocks: int
    used_blocks: int
    free_blocks: int
    num_sequences: int
    block_size: int

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks


class BlockManager:
    """One block table per sequence id; each batch call validates the whole batch before changing anything.

    NOTE: block tables are append-only: `extend` only adds blocks, and only `free` releases them.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        assert block_size > 0, block_size
        self.allocator = allocator
        self.block_size = block_size
        self._seqs: dict[str, _Sequence] = {}
        self._refcounts = [0] * allocator.num_total

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # allocate

    def can_allocate(self, requests: Sequence[SeqRequest]) -> bool:
        """Whether the new sequences fit in the free blocks; raises like `allocate` if invalid."""
        return self._check_allocate(requests) <= self.allocator.num_free

    def allocate(self, requests: Sequence[SeqRequest]) -> list[list[int]]:
        """Creates the block table of each new sequence and returns them in request order; all or nothing.

        Raises InvalidArgument (empty id, num_tokens <= 0), AlreadyExists (the sequence has a table or is
        listed twice) and ResourceExhausted (not enough free blocks); on any error nothing changed.
        """
        self._ensure_free(self._check_allocate(requests))
        for request in requests:
            seq = self._seqs[request.seq_id] = _Sequence(request.num_tokens)
            self._grow(seq, self.blocks_needed(request.num_tokens))
        return [self.block_table(request.seq_id) for request in requests]

    def _check_allocate(self, requests: Sequence[SeqRequest]) -> int:
        seen: set[str] = set()
        for request in requests:
            self._check_request(request)
            if request.seq_id in self._seqs:
                raise AlreadyExists(
                    f"sequence {request.seq_id!r} already has a block table: Extend or Free it"
                )
            if request.seq_id in seen:
                raise AlreadyExists(f"sequence {request.seq_id!r} is listed twice in one Allocate")
            seen.add(request.seq_id)
        return sum(self.blocks_needed(request.num_tokens) for request in requests)

    # extend

    def can_extend(self, requests: Sequence[SeqRequest]) -> bool:
        """Whether the growth of these sequences fits in the free blocks; raises like `extend` if invalid."""
        return self._check_extend(requests) <= self.allocator.num_free

    def extend(self, requests: Sequence[SeqRequest]) -> list[list[int]]:
        """Grows each sequence's table to hold num_tokens and returns the full tables in request order.

        Asking for the tokens a sequence already holds changes nothing. Raises NotFound (unknown sequence),
        InvalidArgument (empty id, num_tokens <= 0 or below what the sequence holds, listed twice) and
        ResourceExhausted (not enough free blocks); on any error nothing changed.
        """
        self._ensure_free(self._check_extend(requests))
        for request in requests:
            seq = self._seqs[request.seq_id]
            seq.num_tokens = request.num_tokens
            self._grow(seq, self.blocks_needed(request.num_tokens) - len(seq.block_table))
        return [self.block_table(request.seq_id) for request in requests]

    def _check_extend(self, requests: Sequence[SeqRequest]) -> int:
        for request in requests:
            self._check_request(request)
        self._check_known([request.seq_id for request in requests])
        seen: set[str] = set()
        need = 0
        for request in requests:
            seq = self._seqs[request.seq_id]
            if request.seq_id in seen:
                raise InvalidArgument(f"sequence {request.seq_id!r} is listed twice in one Extend")
            if request.num_tokens < seq.num_tokens:
                raise InvalidArgument(
                    f"sequence {request.seq_id!r} holds {seq.num_tokens} tokens: Extend cannot shrink it to "
                    f"{request.num_tokens} (Free it and Allocate again)"
                )
            seen.add(request.seq_id)
            need += self.blocks_needed(request.num_tokens) - len(seq.block_table)
        return need

    # free

    def free(self, seq_ids: Sequence[str]) -> int:
        """Drops the sequences' tables and returns how many blocks became free; all or nothing.

        Raises NotFound (unknown sequence) and InvalidArgument (listed twice); on any error nothing changed.
        """
        self._check_known(seq_ids)
        twice = sorted(seq_id for seq_id, count in Counter(seq_ids).items() if count > 1)
        if twice:
            raise InvalidArgument(f"sequences {twice} are listed twice in one Free")
        released = []
        for seq_id in seq_ids:
            for block_id in self._seqs.pop(seq_id).block_table:
                assert self._refcounts[block_id] > 0, block_id
                self._refcounts[block_id] -= 1
                if self._refcounts[block_id] == 0:
                    released.append(block_id)
        self.allocator.free(released)
        return len(released)

    # queries

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of the sequence's block table; NotFound if the sequence has none."""
        self._check_known([seq_id])
        return list(self._seqs[seq_id].block_table)

    def refcount(self, block_id: int) -> int:
        """How many block tables hold the block; InvalidArgument if it is out of range."""
        if not 0 <= block_id < self.allocator.num_total:
            raise InvalidArgument(
                f"block {block_id} does not exist: the pool has {self.allocator.num_total} blocks"
            )
        return self._refcounts[block_id]

    def stats(self) -> BlockStats:
        free = self.allocator.num_free
        total = self.allocator.num_total
        return BlockStats(total, total - free, free, len(self._seqs), self.block_size)

    def check_invariants(self) -> None:
        """Asserts: refcount == tables holding the block; free + used == total; free and used are disjoint;
        no table holds a block twice; each table has exactly the blocks its tokens need."""
        total = self.allocator.num_total
        holders = [0] * total
        for seq_id, seq in self._seqs.items():
            table = seq.block_table
            assert len(set(table)) == len(table), f"sequence {seq_id!r} holds a block twice: {table}"
            assert len(table) == self.blocks_needed(seq.num_tokens), (seq_id, seq.num_tokens, table)
            for block_id in table:
                holders[block_id] += 1
        assert holders == self._refcounts, "refcounts differ from the block tables"
        used = sum(1 for count in self._refcounts if count > 0)
        assert used + self.allocator.num_free == total, (used, self.allocator.num_free, total)
        both = [b for b, count in enumerate(self._refcounts) if count > 0 and self.allocator.is_free(b)]
        assert not both, f"blocks both free and used: {both}"

    # helpers

    def _check_request(self, request: SeqRequest) -> None:
        if not request.seq_id:
            raise InvalidArgument("seq_id must not be empty")
        if request.num_tokens <= 0:
            raise InvalidArgument(
                f"sequence {request.seq_id!r}: num_tokens must be > 0, got {request.num_tokens}"
            )

    def _check_known(self, seq_ids: Sequence[str]) -> None:
        unknown = sorted({seq_id for seq_id in seq_ids if seq_id not in self._seqs})
        if unknown:
            raise NotFound(f"unknown sequences {unknown}: Allocate them first (or they were freed)")

    def _ensure_free(self, need: int) -> None:
        free, total = self.allocator.num_free, self.allocator.num_total
        if need > free:
            raise ResourceExhausted(
                f"need {need} blocks, {free} free of {total} (block_size {self.block_size}): "
                "free or preempt sequences, or give the pool more memory"
            )

    def _grow(self, seq: _Sequence, n: int) -> None:
        block_ids = self.allocator.allocate(n, hint=seq.block_table)
        for block_id in block_ids:
            assert self._refcounts[block_id] == 0, block_id
            self._refcounts[block_id] = 1
        seq.block_table.extend(block_ids)
