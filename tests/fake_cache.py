"""A stand-in for the cache service's stub, for the gateway's unit tests: block tables with refcounts,
fork and copy-on-write, no prefix cache; every reply reports the blocks left, as the real service does."""

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

    def Reserve(self, request: cache_pb2.ReserveRequest, **_) -> cache_pb2.BlockTables:
        self.calls.append("Reserve")
        tables = []
        for seq in request.new_seqs:
            assert seq.seq_id not in self.tables and len(seq.token_ids) == seq.num_tokens, seq.seq_id
            tables.append(self._grow(seq, 0))
        tables += [self._grow(seq, seq.num_computed // self.block_size) for seq in request.running_seqs]
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

    def _grow(self, seq: cache_pb2.SequenceRequest, first: int) -> cache_pb2.BlockTable:
        """Copies the shared blocks from `first` on, grows the table to num_tokens; returns its tail."""
        table = self.tables.setdefault(seq.seq_id, [])
        for index in range(first, len(table)):
            if self.refs[table[index]] > 1:
                self.refs[table[index]] -= 1
                table[index] = self._take()
        while len(table) < blocks_for(seq.num_tokens, self.block_size):
            table.append(self._take())
        return cache_pb2.BlockTable(seq_id=seq.seq_id, block_ids=table[first:], first_block=first)

    def _take(self) -> int:
        assert self.free, "the gateway reserved more blocks than the cache service has"
        block_id = self.free.pop(0)
        self.refs[block_id] = 1
        return block_id
