"""Random packed attention steps over a paged pool, run through the cpu backend (the reference every device
backend must match): what the device backends' argument tests and CUDA kernel tests replay."""

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from compute_service.architectures import FULL, LayerAttention
from compute_service.attention.context import build_context, reset_context, set_context
from compute_service.batch import ForwardBatch
from compute_service.validation import Limits
from tests.forward import forward_request

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
SCALE = HEAD_DIM**-0.5
# (new tokens, cached tokens) per sequence: fresh prompts, chunks after a cached prefix, decodes of
# several lengths, and all of them in one step.
SCENARIOS = {
    "prompts": ([5, 9, 2], [0, 0, 0]),
    "chunks": ([4, 7, 3], [6, 13, 1]),
    "decodes": ([1, 1, 1, 1], [7, 12, 3, 12]),
    "mixed": ([1, 6, 3, 1], [9, 0, 5, 2]),
}
# Sliding windows shorter and longer than the scenarios' contexts and a block, and soft-caps.
PATTERNS = {
    "window3": LayerAttention(3),
    "window7": LayerAttention(7),
    "window5-softcap2": LayerAttention(5, 2.0),
    "softcap4": LayerAttention(0, 4.0),
}


@dataclass
class Step:
    """One step's inputs (q/k/v of the new tokens, [T, heads, D]), its checked batch, the pool before the
    step, and the cpu backend's output and pool after it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    batch: ForwardBatch
    k_before: torch.Tensor
    v_before: torch.Tensor
    out: torch.Tensor
    k_after: torch.Tensor
    v_after: torch.Tensor


def make_step(
    new: list[int],
    cached: list[int],
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attends: LayerAttention = FULL,
) -> Step:
    """A step over shuffled blocks in a pool of finite garbage (its cached K/V), run by the cpu backend for a
    layer that attends as `attends` says."""
    from compute_service.attention.cpu import paged_attention

    gen = torch.Generator().manual_seed(seed)
    total = sum(-(-(n + c) // block_size) for n, c in zip(new, cached, strict=True))
    num_blocks = total + 3
    order, tables = torch.randperm(num_blocks, generator=gen).tolist(), []
    for n, c in zip(new, cached, strict=True):
        count = -(-(n + c) // block_size)
        tables.append(order[:count])
        order = order[count:]
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k_pool, v_pool = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    tokens = sum(new)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    limits = Limits(vocab_size=1, max_model_len=4096, num_blocks=num_blocks, block_size=block_size)
    request = forward_request([[0] * n for n in new], cached, tables, block_size=block_size)
    batch = ForwardBatch.from_request(request, limits)
    k_after, v_after = k_pool.clone(), v_pool.clone()
    out = run_backend(paged_attention, q, k, v, batch, k_after, v_after, attends)
    return Step(q, k, v, batch, k_pool, v_pool, out, k_after, v_after)


def run_backend(
    backend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    k_pool,
    v_pool,
    attends: LayerAttention = FULL,
) -> torch.Tensor:
    """One layer of the backend attending as `attends` says, over the pool (written in place): [T, H, D]."""
    set_context(build_context([k_pool], [v_pool], batch, layers=(attends,)))
    try:
        out, _ = backend(
            SimpleNamespace(layer_idx=0),
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            None,
            scaling=SCALE,
            sliding_window=attends.window or None,
            softcap=attends.softcap or None,
        )
    finally:
        reset_context()
    return out[0]
