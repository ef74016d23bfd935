"""Embedding inputs in the update stage: what each step pooled of them (ForwardResponse.pooled, one row per
sequence whose chunk pooled, in order) added to their sums; an input whose last chunk ran ends, with its
embedding (the mean's sum divided by its tokens) on its Output. Normalising and truncating to a request's
dimensions are the request's (gateway.embedding)."""

import numpy as np

from gateway.outputs import Output
from gateway.sequence import Sequence
from protos import compute_pb2


def pooled_rows(seqs: list[Sequence]) -> list[Sequence]:
    """The step's sequences whose chunk pools (ask before the update moves their progress on)."""
    return [seq for seq in seqs if seq.pools_now]


def take_pooled(
    seqs: list[Sequence],
    rows: list[Sequence],
    reply: compute_pb2.ForwardResponse,
    faulty: list[tuple[Sequence, Exception]],
) -> list[tuple[Sequence, Output]]:
    """Adds each pooling row's (`rows`, of the step's `seqs`) pooled hidden states to its sum; each embedding
    input of the step whose whole input is computed ends (finish_reason "stop") with its embedding. A row
    whose values cannot be taken goes to `faulty`, with the exception, for its request to fail alone."""
    values = np.frombuffer(reply.pooled, dtype="<f4")
    width = len(values) // len(rows) if rows else 0
    for i, seq in enumerate(rows):
        try:
            if width * len(rows) != len(values) or not width:
                raise ValueError(f"{len(reply.pooled)} bytes of pooled values for {len(rows)} pooling rows")
            row = values[i * width : (i + 1) * width]
            seq.pooled = row.copy() if seq.pooled is None else seq.pooled + row
        except Exception as exc:  # noqa: BLE001 - that row's fault: its request fails alone
            faulty.append((seq, exc))
    failed = {id(seq) for seq, _ in faulty}
    outputs = []
    for seq in seqs:
        if seq.pooling and id(seq) not in failed and seq.chunk_end == seq.num_tokens:
            embedding = seq.pooled / seq.num_tokens if seq.pooling == "mean" else seq.pooled
            seq.finish_reason = "stop"
            outputs.append((seq, Output([], "stop", seq.index, embedding=embedding)))
    return outputs
