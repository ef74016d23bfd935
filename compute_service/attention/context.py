"""The per-step attention context: pool views and step metadata, derived once per step for every layer."""

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.errors import Unimplemented
from compute_service.architectures import FULL, LayerAttention
from compute_service.attention.kv_codec import NO_SCALES, KVScales
from compute_service.attention.sparse import SparseDecode
from compute_service.batch import ForwardBatch

# What transformers passes an attention function besides the tensors, that paged attention reads or may
# ignore (the step's positions are in the context; dropout is 0 in eval mode).
KNOWN_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "softcap", "position_ids", "use_cache"})


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
    # How each layer attends (compute_service.architectures.layer_attention); none: every layer FULL.
    layers: tuple[LayerAttention, ...] = ()
    # Block-sparse decode (--sparse-attention), for the layers without a sliding window; None: dense.
    sparse: SparseDecode | None = None
    # Seconds spent in the attention function this step, summed over layers (see `timed`).
    attention_s: float = 0.0
    # Per-backend data derived from the step once, by the first layer that needs it (the cpu backend's
    # decode groups and prompt masks, cpu-native's kernel inputs, a device backend's kernel arguments), by
    # backend name.
    derived: dict[str, object] = field(default_factory=dict)
    # A pool of several KV groups: each group's context (its tables and slots; this one is group 0's), and
    # each layer's group. Empty: one group.
    groups: tuple["Context", ...] = ()
    layer_groups: tuple[int, ...] = ()


_CONTEXT: Context | None = None


def get_context() -> Context:
    assert _CONTEXT is not None, "paged attention called outside a step: set_context() first"
    return _CONTEXT


def layer_call(
    module: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict
) -> tuple[Context, torch.Tensor, torch.Tensor, LayerAttention]:
    """For a backend's transformers attention function: the step's context as the layer's KV group sees it
    (its tables and slots), the layer's K and V caches and how it attends. Unimplemented if the call asks
    for what paged attention does not do: a mask of the model's own, a window or soft-cap other than the
    model's config gives (the pattern the cache keeps blocks by), or an argument it does not know
    (attention sinks, say)."""
    ctx = get_context()
    layer = module.layer_idx
    attends = ctx.layers[layer] if ctx.layers else FULL
    unknown = sorted(set(kwargs) - KNOWN_KWARGS)
    window, softcap = kwargs.get("sliding_window") or 0, kwargs.get("softcap") or 0.0
    asked = ""
    if attention_mask is not None:
        asked = "a mask of its own"
    elif unknown:
        asked = f"arguments it does not know ({', '.join(unknown)})"
    elif window not in (0, attends.window) or softcap != attends.softcap:
        asked = f"sliding_window={window}, softcap={softcap}"
    if asked:
        raise Unimplemented(
            f"layer {layer} calls paged attention with {asked}, where the model's config gives window "
            f"{attends.window}, softcap {attends.softcap}: this attention is not implemented"
        )
    group = ctx.groups[ctx.layer_groups[layer]] if ctx.groups else ctx
    return group, ctx.k_caches[layer], ctx.v_caches[layer], attends


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
    layers: tuple[LayerAttention, ...] = (),
    sparse: SparseDecode | None = None,
    layer_groups: tuple[int, ...] = (),
) -> Context:
    """What the layers share, from a checked batch (see compute_service.batch), for layers that attend as
    `layers` says (none: all FULL), their decodes block-sparse when `sparse` is given. On a pool of several
    KV groups (the batch's group_tables), layer i reads and writes by group layer_groups[i]'s tables."""
    each = [_context(k_caches, v_caches, part, scales, layers, sparse) for part in batch.by_group()]
    if len(each) > 1:
        each[0].groups, each[0].layer_groups = tuple(each), layer_groups
    return each[0]


def _context(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    batch: ForwardBatch,
    scales: KVScales,
    layers: tuple[LayerAttention, ...],
    sparse: SparseDecode | None,
) -> Context:
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
        layers=layers,
        sparse=sparse,
    )
