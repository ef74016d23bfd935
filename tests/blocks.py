"""Shorthands over `BlockManager.reserve` for tests: a step that only admits new sequences, or one that only
grows running ones; each returns the whole tables, in request order."""

from collections.abc import Sequence

from cache_service.block_manager import BlockManager
from cache_service.sequence import SeqRequest


def allocate(blocks: BlockManager, requests: Sequence[SeqRequest]) -> list[list[int]]:
    blocks.reserve(requests, ())
    return [blocks.block_table(request.seq_id) for request in requests]


def extend(blocks: BlockManager, requests: Sequence[SeqRequest]) -> list[list[int]]:
    blocks.reserve((), requests)
    return [blocks.block_table(request.seq_id) for request in requests]
