"""Building packed ForwardRequests by hand, for tests that drive the compute side directly, and the
gateway sequences whose steps the gateway's own requests are built from."""

from common.paging import blocks_for
from gateway.sampling import resolve_sampling
from gateway.sequence import Sequence
from protos import compute_pb2, generation_pb2


def forward_request(
    new: list[list[int]],
    cached: list[int],
    tables: list[list[int]],
    *,
    block_size: int,
    sample: list[bool] | None = None,
    epoch: str = "",
) -> compute_pb2.ForwardRequest:
    """One packed step: `new[i]` tokens of sequence i after its `cached[i]` tokens, greedy sampling; each
    table cut to the blocks its sequence needs, rows padded with -1."""
    sample = sample or [True] * len(new)
    cu = [0]
    for tokens in new:
        cu.append(cu[-1] + len(tokens))
    rows = [
        table[: blocks_for(start + len(tokens), block_size)]
        for tokens, start, table in zip(new, cached, tables, strict=True)
    ]
    width = max(map(len, rows))
    return compute_pb2.ForwardRequest(
        pool_epoch=epoch,
        token_ids=[t for tokens in new for t in tokens],
        cu_seqlens_q=cu,
        num_computed=cached,
        block_tables=[b for row in rows for b in row + [-1] * (width - len(row))],
        block_table_width=width,
        sample=sample,
        sampling=[compute_pb2.RowSampling(temperature=0)] * sum(sample),
    )


def set_field(field: str, index: int, value):
    """A mutation of a request: `field[index] = value`."""

    def mutate(request: compute_pb2.ForwardRequest) -> None:
        getattr(request, field)[index] = value

    return mutate


def replace_field(field: str, values: list):
    """A mutation of a request: `field` becomes `values`."""

    def mutate(request: compute_pb2.ForwardRequest) -> None:
        del getattr(request, field)[:]
        getattr(request, field).extend(values)

    return mutate


def gateway_seq(prompt: list[int], num_computed: int, chunk_end: int, vocab_size: int) -> Sequence:
    """A greedy gateway sequence of `prompt` whose step computes [num_computed, chunk_end)."""
    sampling = resolve_sampling(generation_pb2.SamplingParams(temperature=0, max_tokens=8), vocab_size)
    seq = Sequence(seq_id=f"s{len(prompt)}", prompt_ids=prompt, sampling=sampling, max_len=64)
    seq.num_computed, seq.chunk_end = num_computed, chunk_end
    return seq
