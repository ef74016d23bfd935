"""Conversions between the Cache service's messages and the block manager's types."""

from collections.abc import Sequence

from cache_service.block_manager import BlockManager
from cache_service.sequence import SeqRequest, TableTail
from cache_service.sessions import Session
from protos import cache_pb2


def seq_request(seq: cache_pb2.SequenceRequest) -> SeqRequest:
    return SeqRequest(
        seq.seq_id,
        seq.num_tokens,
        list(seq.token_ids),
        seq.num_computed,
        seq.cache_salt,
        seq.max_compute_tokens,
        seq.lookahead_tokens,
        seq.lora_id,
        seq.lora_name,
    )


def block_tables(
    seq_ids: Sequence[str], tails: Sequence[Sequence[TableTail]], available: int
) -> cache_pb2.BlockTables:
    """Reserve's reply: per KV group (`tails[g]`), each table's tail, in the request's order (new, then
    running); group 0's in the table's own fields, the others' in its `groups`."""
    return cache_pb2.BlockTables(
        tables=[
            cache_pb2.BlockTable(
                seq_id=seq_id,
                block_ids=tail.block_ids,
                cached_tokens=tail.cached_tokens,
                first_block=tail.first,
                num_tokens=tail.num_tokens,
                groups=[
                    cache_pb2.GroupTable(block_ids=t[i].block_ids, first_block=t[i].first) for t in tails[1:]
                ],
            )
            for i, (seq_id, tail) in enumerate(zip(seq_ids, tails[0], strict=True))
        ],
        available_blocks=available,
    )


def forked_tables(
    child_ids: Sequence[str], tables: Sequence[Sequence[list[int]]], available: int
) -> cache_pb2.BlockTables:
    """Fork's reply: each child's whole table per KV group (`tables[g]`), group 0's in the table's own
    fields."""
    return cache_pb2.BlockTables(
        tables=[
            cache_pb2.BlockTable(
                seq_id=seq_id,
                block_ids=table,
                groups=[cache_pb2.GroupTable(block_ids=t[i]) for t in tables[1:]],
            )
            for i, (seq_id, table) in enumerate(zip(child_ids, tables[0], strict=True))
        ],
        available_blocks=available,
    )


def lookup_response(prefixes: Sequence[list[int]], blocks: BlockManager) -> cache_pb2.LookupResponse:
    """Lookup's reply: each prompt's cached prefix, in tokens and in blocks, and the blocks available."""
    return cache_pb2.LookupResponse(
        cached_tokens=[len(block_ids) * blocks.block_size for block_ids in prefixes],
        prefix_blocks=[cache_pb2.PrefixBlocks(block_ids=block_ids) for block_ids in prefixes],
        available_blocks=blocks.num_available,
    )


def session(session_id: str, state: Session) -> cache_pb2.Session:
    return cache_pb2.Session(
        session_id=session_id, ttl_s=state.ttl_s, num_sequences=len(state.seqs), epoch=state.epoch
    )
