"""A stand-in for the cache service's stub, for the gateway's unit tests: block tables with refcounts,
fork and copy-on-write; no prefix cache, but every prompt's first `cached_prefix` tokens (in whole blocks,
never the last token) count as cached in Lookup and Reserve, whose max_compute_tokens trims a new table as
the real service does; every reply reports the blocks left, as the real service does."""

from collections import Counter

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

    def cached(self, num_tokens: int) -> int:
        """Cached tokens of a prompt of num_tokens: whole blocks, never the last token."""
        return min(self.cached_prefix, num_tokens - 1) // self.block_size * self.block_size

    def Lookup(self, request: cache_pb2.LookupRequest, **_) -> cache_pb2.LookupResponse:
        self.calls.append("Lookup")
        assert all(len(seq.token_ids) == seq.num_tokens for seq in request.seqs)
        cached = [self.cached(seq.num_tokens) for seq in request.seqs]
        return cache_pb2.LookupResponse(cached_tokens=cached, available_blocks=len(self.free))

    def Reserve(self, request: cache_pb2.ReserveRequest, **_) -> cache_pb2.BlockTables:
        self.calls.append("Reserve")
        tables = []
        for seq in request.new_seqs:
            assert seq.seq_id not in self.tables and len(seq.token_ids) == seq.num_tokens, seq.seq_id
            hits, end = self.cached(seq.num_tokens), seq.num_tokens
            if seq.max_compute_tokens:
                end = min(end, hits + seq.max_compute_tokens)
            table = self._grow(seq.seq_id, end, 0)
            table.cached_tokens, table.num_tokens = hits, end
            tables.append(table)
        tables += [
            self._grow(s.seq_id, s.num_tokens, s.num_computed // self.block_size)
            for s in request.running_seqs
        ]
        return cache_pb2.BlockTables(tables=tables, available_blocks=len(self.free))

    def Fork(self, request: cache_pb2.ForkRequest, **_) -> cache_pb2.BlockTables:
        self.calls.append("Fork")
        parent = self.tables[request.parent_id]
        for child_id in request.child_ids:
            self.tables[child_id] = list(parent)
            self.refs.update(parent)
        tables = [cache_pb2.BlockTable(seq_id=c, block_ids=parent) for c in request.child_ids]
        return cache_pb2.BlockTables(tables=tables, available_blocks=len(self.free))

    def Free(self, request: cache_pb2.FreeRequest, **_) -> cache_pb2.FreeResponse:
        self.calls.append("Free")
        for seq_id in request.seq_ids:
            for block_id in self.tables.pop(seq_id):
                self.refs[block_id] -= 1
                if not self.refs[block_id]:
                    self.free.append(block_id)
        return cache_pb2.FreeResponse(available_blocks=len(self.free))

    def _grow(self, seq_id: str, num_tokens: int, first: int) -> cache_pb2.BlockTable:
        """Copies the shared blocks from `first` on, grows the table to num_tokens; returns its tail."""
        table = self.tables.setdefault(seq_id, [])
        for index in range(first, len(table)):
            if self.refs[table[index]] > 1:
                self.refs[table[index]] -= 1
                table[index] = self._take()
        while len(table) < blocks_for(num_tokens, self.block_size):
            table.append(self._take())
        return cache_pb2.BlockTable(seq_id=seq_id, block_ids=table[first:], first_block=first)

    def _take(self) -> int:
        assert self.free, "the gateway reserved more blocks than the cache service has"
        block_id = self.free.pop(0)
        self.refs[block_id] = 1
        return block_id
