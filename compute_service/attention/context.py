"""The per-step attention context: pool views and step metadata, derived once per step for every layer."""

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from compute_service.attention.kv_codec import NO_SCALES, KVScales
from compute_service.batch import ForwardBatch


@dataclass(slots=True)
class Context:
    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    cu_seqlens_q: torch.Tensor  # [N + 1]
    context_lens: torch.Tensor  # [N]
    block_tables: torch.Tensor  # [N, W], -1 padded
    prompt_rows: list[int]  # the sequences with more than one new token; the others decode
    # The pool's fp8 scales per layer (none for other dtypes).
    scales: KVScales = NO_SCALES
    # Seconds spent in the attention function this step, summed over layers (see `timed`).
    attention_s: float = 0.0
    # Per-backend data derived from the step once, by the first layer that needs it (the cpu backend's
    # decode groups and prompt masks, cpu-native's kernel inputs, a device backend's kernel arguments), by
    # backend name.
    derived: dict[str, object] = field(default_factory=dict)


_CONTEXT: Context | None = None


def get_context() -> Context:
    assert _CONTEXT is not None, "paged attention called outside a step: set_context() first"
    return _CONTEXT


def layer_call(
    module: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict
) -> tuple[Context, torch.Tensor, torch.Tensor]:
    """For a backend's transformers attention function: the step's context and the layer's K and V caches.
    Asserts the call is one paged attention serves (no mask of the model's, no sliding window, no softcap)."""
    assert attention_mask is None, "paged attention builds its own masks; the model must not pass one"
    assert kwargs.get("sliding_window") is None and kwargs.get("softcap") is None, "not supported yet"
    ctx = get_context()
    return ctx, ctx.k_caches[module.layer_idx], ctx.v_caches[module.layer_idx]


def set_context(context: Context) -> None:
    global _CONTEXT
    _CONTEXT = context


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None


def timed(backend: Callable) -> Callable:
    """The backend, its time added to the step's `attention_s` (one clock read pair per layer)."""

    @functools.wraps(backend)
    def attention(*args, **kwargs):
        start = time.perf_counter()
        try:
            return backend(*args, **kwargs)
        finally:
            get_context().attention_s += time.perf_counter() - start

    return attention


def build_context(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    batch: ForwardBatch,
    scales: KVScales = NO_SCALES,
) -> Context:
    """What the layers share, from a checked batch (see compute_service.batch)."""
    cu_seqlens_q, context_lens, block_tables = batch.cu_seqlens_q, batch.context_lens, batch.block_tables
    assert block_tables.dim() == 2 and len(block_tables) == len(context_lens) == len(cu_seqlens_q) - 1
    return Context(
        k_caches,
        v_caches,
        batch.slot_mapping,
        cu_seqlens_q,
        context_lens,
        block_tables,
        prompt_rows=batch.prompt_rows,
        scales=scales,
    )
