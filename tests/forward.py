"""Building packed ForwardRequests by hand, for tests that drive the compute side directly."""

from protos import compute_pb2


def forward_request(
    new: list[list[int]],
    cached: list[int],
    tables: list[list[int]],
    *,
    block_size: int,
    sample: list[bool] | None = None,
    epoch: str = "",
) -> compute_pb2.ForwardRequest:
    """One packed step: `new[i]` tokens of sequence i after its `cached[i]` tokens, greedy sampling."""
    sample = sample or [True] * len(new)
    token_ids, positions, slots, cu, context_lens, rows = [], [], [], [0], [], []
    for tokens, start, table in zip(new, cached, tables, strict=True):
        span = range(start, start + len(tokens))
        token_ids += tokens
        positions += span
        slots += [table[p // block_size] * block_size + p % block_size for p in span]
        cu.append(cu[-1] + len(tokens))
        context_lens.append(span.stop)
        rows.append(table[: -(-span.stop // block_size)])
    width = max(map(len, rows))
    return compute_pb2.ForwardRequest(
        pool_epoch=epoch,
        token_ids=token_ids,
        positions=positions,
        cu_seqlens_q=cu,
        context_lens=context_lens,
        block_tables=[b for row in rows for b in row + [-1] * (width - len(row))],
        block_table_width=width,
        slot_mapping=slots,
        sample=sample,
        sampling=[compute_pb2.RowSampling(temperature=0)] * sum(sample),
    )
