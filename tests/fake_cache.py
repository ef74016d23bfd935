"""A stand-in for the cache service's stub, for the gateway's unit tests: block tables with refcounts,
fork and copy-on-write; no prefix cache, but every prompt's first `cached_prefix` tokens (in whole blocks,
never the last token) count as cached in Lookup and Reserve, whose max_compute_tokens trims a new table as
the real service does; every reply reports the blocks left, as the real service does.

With `cache_prefix(n)`, n blocks hold every prompt's first n blocks instead (the tests' prompts share their
leading tokens): a new table shares its hits (Lookup names them), a hit on a block no table holds revives
it, and such blocks count as available and are evicted (last first) when free ones run out. A Reserve
that does not fit is refused with RESOURCE_EXHAUSTED and changes nothing, as the real service's."""

import copy
from collections import Counter

import grpc

from common.paging import blocks_for
from protos import cache_pb2


class FakeCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.refs: Counter[int] = Counter()
        self.tables: dict[str, list[int]] = {}
        self.calls: list[str] = []
        self.cached_prefix = 0
        self.prefix: list[int] = []  # blocks holding every prompt's leading blocks (cache_prefix)
        self.progress: dict[str, int] = {}  # the last Lookup's num_computed

    @property
    def available(self) -> int:
        """Free blocks plus the prefix blocks no table holds (evictable)."""
        return len(self.free) + sum(1 for block_id in self.prefix if not self.refs[block_id])

    def cache_prefix(self, num_blocks: int) -> list[int]:
        """Free blocks that now hold every prompt's first num_blocks blocks, cached (held by no table)."""
        assert not self.prefix and num_blocks <= len(self.free), num_blocks
        self.prefix, self.free = self.free[:num_blocks], self.free[num_blocks:]
        return list(self.prefix)

    def prefix_hits(self, num_tokens: int) -> list[int]:
        """The prefix blocks a prompt of num_tokens shares: whole blocks, never the last token's."""
        return self.prefix[: (num_tokens - 1) // self.block_size]

    def cached(self, num_tokens: int) -> int:
        """Cached tokens of a prompt of num_tokens: whole blocks, never the last token."""
        if self.prefix:
            return len(self.prefix_hits(num_tokens)) * self.block_size
        return min(self.cached_prefix, num_tokens - 1) // self.block_size * self.block_size

    def Lookup(self, request: cache_pb2.LookupRequest, **_) -> cache_pb2.LookupResponse:
        self.calls.append("Lookup")
        assert all(len(seq.token_ids) == seq.num_tokens for seq in request.seqs)
        self.progress = dict(request.num_computed)
        cached = [self.cached(seq.num_tokens) for seq in request.seqs]
        blocks = [cache_pb2.PrefixBlocks(block_ids=self.prefix_hits(seq.num_tokens)) for seq in request.seqs]
        return cache_pb2.LookupResponse(
            cached_tokens=cached, available_blocks=self.available, prefix_blocks=blocks if self.prefix else []
        )

    def Reserve(self, request: cache_pb2.ReserveRequest, **_) -> cache_pb2.BlockTables:
        self.calls.append("Reserve")
        before = copy.deepcopy((self.free, self.refs, self.tables, self.prefix))
        try:
            tables = [self._new(seq) for seq in request.new_seqs]
            tables += [
                self._grow(s.seq_id, s.num_tokens + s.lookahead_tokens, s.num_computed // self.block_size)
                for s in request.running_seqs
            ]
        except _OutOfBlocks:
            self.free, self.refs, self.tables, self.prefix = before
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "need more blocks than are free") from None
        return cache_pb2.BlockTables(tables=tables, available_blocks=self.available)

    def _new(self, seq: cache_pb2.SequenceRequest) -> cache_pb2.BlockTable:
        assert seq.seq_id not in self.tables and len(seq.token_ids) == seq.num_tokens, seq.seq_id
        hits, end = self.cached(seq.num_tokens), seq.num_tokens
        if seq.max_compute_tokens:
            end = min(end, hits + seq.max_compute_tokens)
        shared = self.tables[seq.seq_id] = list(self.prefix_hits(seq.num_tokens))
        self.refs.update(shared)
        self._grow(seq.seq_id, end, len(shared))
        table = self.tables[seq.seq_id]
        return cache_pb2.BlockTable(seq_id=seq.seq_id, block_ids=table, cached_tokens=hits, num_tokens=end)

    def Fork(self, request: cache_pb2.ForkRequest, **_) -> cache_pb2.BlockTables:
        self.calls.append("Fork")
        parent = self.tables[request.parent_id]
        for child_id in request.child_ids:
            self.tables[child_id] = list(parent)
            self.refs.update(parent)
        tables = [cache_pb2.BlockTable(seq_id=c, block_ids=parent) for c in request.child_ids]
        return cache_pb2.BlockTables(tables=tables, available_blocks=self.available)

    def Free(self, request: cache_pb2.FreeRequest, **_) -> cache_pb2.FreeResponse:
        self.calls.append("Free")
        for seq_id in request.seq_ids:
            for block_id in self.tables.pop(seq_id):
                self.refs[block_id] -= 1
                if not self.refs[block_id] and block_id not in self.prefix:
                    self.free.append(block_id)
        return cache_pb2.FreeResponse(available_blocks=self.available)

    def _grow(self, seq_id: str, num_tokens: int, first: int) -> cache_pb2.BlockTable:
        """Copies the shared blocks from `first` on, grows the table to num_tokens (lookahead included);
        returns its tail."""
        table = self.tables.setdefault(seq_id, [])
        for index in range(first, len(table)):
            if self.refs[table[index]] > 1:
                self.refs[table[index]] -= 1
                table[index] = self._take()
        while len(table) < blocks_for(num_tokens, self.block_size):
            table.append(self._take())
        return cache_pb2.BlockTable(seq_id=seq_id, block_ids=table[first:], first_block=first)

    def _take(self) -> int:
        if not self.free and self.prefix and not self.refs[self.prefix[-1]]:
            self.free.append(self.prefix.pop())  # evicted
        if not self.free:
            raise _OutOfBlocks
        block_id = self.free.pop(0)
        self.refs[block_id] = 1
        return block_id


class _OutOfBlocks(Exception):
    """A Reserve took more blocks than the pool has."""


class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing
