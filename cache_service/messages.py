"""Conversions between the Cache service's messages and the block manager's types."""

from collections.abc import Sequence

from cache_service.sequence import SeqRequest, TableTail
from protos import cache_pb2


def seq_request(seq: cache_pb2.SequenceRequest) -> SeqRequest:
    return SeqRequest(
        seq.seq_id,
        seq.num_tokens,
        list(seq.token_ids),
        seq.num_computed,
        seq.cache_salt,
        seq.max_compute_tokens,
    )


def block_tables(seq_ids: Sequence[str], tails: Sequence[TableTail], available: int) -> cache_pb2.BlockTables:
    """Reserve's reply: each table's tail, in the request's order (new, then running)."""
    return cache_pb2.BlockTables(
        tables=[
            cache_pb2.BlockTable(
                seq_id=seq_id,
                block_ids=tail.block_ids,
                cached_tokens=tail.cached_tokens,
                first_block=tail.first,
                num_tokens=tail.num_tokens,
            )
            for seq_id, tail in zip(seq_ids, tails, strict=True)
        ],
        available_blocks=available,
    )
