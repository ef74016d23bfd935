"""The Forward request of a scheduled step: what only the gateway knows (the new tokens, how many tokens each
sequence already has in the KV cache, the block tables, sampling); compute derives positions and slots."""

from itertools import accumulate

import numpy as np

from gateway.sampling import forward_sampling
from gateway.sequence import Sequence
from protos import compute_pb2


def forward_request(
    seqs: list[Sequence], tables: list[list[int]], epoch: str, eos_ids: frozenset[int]
) -> compute_pb2.ForwardRequest:
    """The step's chunks [num_computed, chunk_end) of `seqs`, whose block tables are `tables`, packed, on the
    pool of `epoch`."""
    width = max(map(len, tables))
    rows = np.full((len(seqs), width), -1, dtype=np.int64)
    for row, table in zip(rows, tables, strict=True):
        row[: len(table)] = table
    return compute_pb2.ForwardRequest(
        pool_epoch=epoch,
        token_ids=[t for seq in seqs for t in seq.token_ids[seq.num_computed : seq.chunk_end]],
        cu_seqlens_q=list(accumulate((seq.chunk_end - seq.num_computed for seq in seqs), initial=0)),
        num_computed=[seq.num_computed for seq in seqs],
        block_tables=rows.ravel().tolist(),
        block_table_width=width,
        sample=[seq.samples_now for seq in seqs],
        **forward_sampling([seq for seq in seqs if seq.samples_now], eos_ids),
    )
