"""The Forward request of a scheduled step: what only the gateway knows (the new tokens, how many tokens each
sequence already has in the KV cache, the block tables, sampling); compute derives positions and slots."""

from itertools import accumulate

import numpy as np

from gateway.sampling import forward_sampling
from gateway.sequence import Sequence
from gateway.vision import forward_images
from protos import compute_pb2


def forward_request(
    seqs: list[Sequence],
    tables: list[list[list[int]]],
    epoch: str,
    eos_ids: frozenset[int],
    session_epoch: int = 0,
) -> compute_pb2.ForwardRequest:
    """The step's chunks [num_computed, chunk_end) of `seqs`, whose block tables in KV group g are
    `tables[g]`, packed, on the pool of `epoch`, for the session opened with `session_epoch` (0: none)."""
    width = max(len(table) for group in tables for table in group)
    rows = np.full((len(tables), len(seqs), width), -1, dtype=np.int64)
    for group_rows, group in zip(rows, tables, strict=True):
        for row, table in zip(group_rows, group, strict=True):
            row[: len(table)] = table
    return compute_pb2.ForwardRequest(
        pool_epoch=epoch,
        session_epoch=session_epoch,
        token_ids=[t for seq in seqs for t in seq.token_ids[seq.num_computed : seq.chunk_end]],
        cu_seqlens_q=list(accumulate((seq.chunk_len for seq in seqs), initial=0)),
        num_computed=[seq.num_computed for seq in seqs],
        block_tables=rows.ravel().tolist(),
        block_table_width=width,
        num_kv_groups=len(tables) if len(tables) > 1 else 0,
        sample=[seq.samples_now for seq in seqs],
        cached_prefix=_flags([seq.cached_prefix for seq in seqs]),
        prompt_chunk=_flags([seq.chunk_end <= len(seq.prompt_ids) for seq in seqs]),
        sparse=_sparse_rows(seqs),
        pool=_flags([seq.pools_now for seq in seqs]),
        **forward_sampling([seq for seq in seqs if seq.samples_now], eos_ids),
        **_prompt_targets(seqs),
        images=forward_images(seqs),
    )


def _prompt_targets(seqs: list[Sequence]) -> dict:
    """The ForwardRequest fields of the rows that score their prompt (none when no row does): each new
    token's next prompt token is its target, so a prompt's last token (which samples) has none."""
    scoring = [seq for seq in seqs if seq.scores_prompt]
    if not scoring:
        return {}
    targets = [seq.prompt_ids[seq.num_computed + 1 : seq.chunk_end + 1] for seq in scoring]
    return {
        "prompt_logprobs": [seq.sampling.prompt_logprobs if seq.scores_prompt else -1 for seq in seqs],
        "prompt_target_ids": [t for row in targets for t in row],
        "cu_prompt_targets": list(accumulate((len(row) for row in targets), initial=0)),
    }


def _flags(flags: list[bool]) -> list[bool]:
    """A per-sequence flag as sent: none when no sequence sets it."""
    return flags if any(flags) else []


def _sparse_rows(seqs: list[Sequence]) -> list[compute_pb2.SparseRow]:
    """Each sequence's block-sparse settings as sent: none where compute has no block-sparse decode."""
    if all(seq.sparse is None for seq in seqs):
        return []
    rows = [seq.sparse or (0, 0, 0) for seq in seqs]
    return [compute_pb2.SparseRow(sink=sink, recent=recent, topk=topk) for sink, recent, topk in rows]
