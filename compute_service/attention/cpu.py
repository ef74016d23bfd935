"""CPU paged attention: K/V written by slot, prompts by per-sequence SDPA, decodes by one batched gather.

K/V are stored in the pool's dtype and read back in the compute dtype (compute_service.attention.kv_codec).
A sliding-window layer reads only the keys in its window; a soft-capped one (Gemma 2) attends in explicit
steps, as transformers' eager attention does, since SDPA has no soft-cap.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common import paging
from compute_service.architectures import LayerAttention
from compute_service.attention import kv_codec
from compute_service.attention.context import Context, layer_call

# The pool dtypes this backend reads and writes (common/shared_pool.py DTYPES: all of them).
KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
GATHER_KEYS = 2048


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Sequences with one new token and the same context length, attended as one batch (see GATHER_KEYS):
    the decodes [first, first + count) of `StepGroups.decode_tokens`, each over its last `keys` keys (all
    of its context, or a sliding window's)."""

    first: int
    count: int
    slots: torch.Tensor  # [count * keys] pool slot of every key seen, sequence after sequence
    keys: int


@dataclass(frozen=True, slots=True)
class Segment:
    """A sequence with more than one new token (a prompt or a chunk of one), attended on its own."""

    start: int
    end: int
    context_len: int
    # Pool slots of the keys its queries see (from the first in the earliest query's window), and which
    # of them each query sees; slots None when nothing is cached before this step (the new keys are read
    # from the step's own K/V), mask None when that attention is plainly causal.
    slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class StepGroups:
    """This step's decodes, grouped by context length, and its prompts, for layers of one window.

    NOTE: decodes are grouped so that each group attends over exactly its keys with no mask: the same SDPA
    kernel and reduction order as an unpaged decode, which keeps bfloat16 outputs identical to transformers'
    own generate (a padded, masked batch rounds differently)."""

    decode_tokens: torch.Tensor  # [n] index of each decode's token in the packed batch, group after group
    decode_groups: list[DecodeGroup]
    prompts: list[Segment]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Stores key/value [T, Hkv, D] at their pool slots (block_id * block_size + offset), quantized to the
    pool's dtype with the layer's (K, V) scales."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    kv_codec.store(k_cache.view(-1, num_kv_heads, head_dim), slots, key, scales[0])
    kv_codec.store(v_cache.view(-1, num_kv_heads, head_dim), slots, value, scales[1])


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The transformers attention function: query [1, H, T, D], key/value [1, Hkv, T, D] -> [1, T, H, D]."""
    ctx, k_cache, v_cache, attends = layer_call(module, attention_mask, kwargs)
    scales = ctx.scales.of_layer(module.layer_idx)
    write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), ctx.slot_mapping, scales)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    groups = step_groups(ctx, attends.window)
    if groups.decode_groups:
        # NOTE: one query select and one output copy per layer; the keys are gathered group by group.
        q = query[0].transpose(0, 1).index_select(0, groups.decode_tokens).unsqueeze(2)
        outs = [
            _decode(q[g.first : g.first + g.count], k_cache, v_cache, g, scaling, scales, attends)
            for g in groups.decode_groups
        ]
        out.index_copy_(0, groups.decode_tokens, outs[0] if len(outs) == 1 else torch.cat(outs))
    for seg in groups.prompts:
        out[seg.start : seg.end] = prefill(query, key, value, k_cache, v_cache, seg, scaling, scales, attends)
    return out.unsqueeze(0), None


def step_groups(ctx: Context, window: int = 0) -> StepGroups:
    """This step's groups for layers of this window (0: full attention), derived by the first such layer and
    shared by the others."""
    key = (__name__, window)
    groups = ctx.derived.get(key)
    if groups is None:
        groups = ctx.derived[key] = StepGroups(*_decode_groups(ctx, window), _segments(ctx, window))
    assert isinstance(groups, StepGroups)
    return groups


def _decode_groups(ctx: Context, window: int) -> tuple[torch.Tensor, list[DecodeGroup]]:
    """The decode sequences ordered by context length: their tokens, and their groups in chunks of at most
    GATHER_KEYS keys; the slots of all of them computed at once.

    NOTE: the key slots are computed here once per step, so each layer gathers its keys with one
    index_select (a copy of whole rows) instead of an advanced index over blocks. A group is split so that
    no gather exceeds GATHER_KEYS keys: SDPA then reads keys still in cache, and the copies stay small
    (several times faster than one gather per group: docs/internals/kernels.md)."""
    rows = (ctx.cu_seqlens_q.diff() == 1).nonzero().squeeze(1)
    if not len(rows):
        return rows, []
    lens, order = ctx.context_lens[rows].sort(stable=True)
    rows = rows[order]
    seen = lens.clamp(max=window) if window else lens
    # NOTE: a row's keys are its last `seen` positions; a shorter row's run past its own (never read).
    positions = (lens - seen)[:, None] + torch.arange(int(seen.max()))
    slots = paging.slots(ctx.block_tables[rows], positions, ctx.k_caches[0].shape[1])
    groups, start = [], 0
    keys, counts = torch.unique_consecutive(seen, return_counts=True)
    for length, count in zip(keys.tolist(), counts.tolist(), strict=True):
        step = max(1, GATHER_KEYS // length)
        for first in range(start, start + count, step):
            last = min(first + step, start + count)
            groups.append(DecodeGroup(first, last - first, slots[first:last, :length].flatten(), length))
        start += count
    return ctx.cu_seqlens_q[rows], groups


def _segments(ctx: Context, window: int) -> list[Segment]:
    if not ctx.prompt_rows:
        return []
    starts, lens, block_size = ctx.cu_seqlens_q.tolist(), ctx.context_lens.tolist(), ctx.k_caches[0].shape[1]
    return [
        _segment(starts[i], starts[i + 1], lens[i], ctx.block_tables[i], block_size, window)
        for i in ctx.prompt_rows
    ]


def _segment(
    start: int, end: int, context_len: int, block_table: torch.Tensor, block_size: int, window: int
) -> Segment:
    q_len = end - start
    cached = context_len - q_len
    if cached == 0 and not window:
        return Segment(start, end, context_len, None, None)
    # the first key any query sees: the window's of the earliest query
    first = max(0, cached - window + 1) if window else 0
    positions = cached + torch.arange(q_len)[:, None]
    keys = torch.arange(first, context_len)[None, :]
    mask = (keys <= positions) & (keys > positions - window) if window else keys <= positions
    slots = paging.slots(block_table, keys[0], block_size) if cached else None
    return Segment(start, end, context_len, slots, mask)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float | None,
    kv_scales: tuple[float, float],
    attends: LayerAttention,
) -> torch.Tensor:
    """q [n, H, 1, D] against the group's gathered keys [n, Hkv, keys, D] -> [n, H, D]."""
    shape = (len(q), group.keys, *k_cache.shape[2:])
    k = _gather(k_cache, group.slots, q.dtype, kv_scales[0]).view(shape).transpose(1, 2)
    v = _gather(v_cache, group.slots, q.dtype, kv_scales[1]).view(shape).transpose(1, 2)
    return attend(q, k, v, scale, None, attends.softcap)[:, :, 0]


def prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: Segment,
    scale: float | None,
    kv_scales: tuple[float, float],
    attends: LayerAttention,
) -> torch.Tensor:
    """One sequence's new queries [1, H, q, D] -> [q, H, D]."""
    q = query[:, :, seg.start : seg.end]
    if seg.slots is None:
        # NOTE: the new keys as the pool holds them, so a prompt attends over the same K/V whether its
        # prefix was cached or computed in this step.
        k = kv_codec.round_trip(key[:, :, seg.start : seg.end], k_cache.dtype, kv_scales[0])
        v = kv_codec.round_trip(value[:, :, seg.start : seg.end], v_cache.dtype, kv_scales[1])
    else:
        k = _gather(k_cache, seg.slots, q.dtype, kv_scales[0]).transpose(0, 1).unsqueeze(0)
        v = _gather(v_cache, seg.slots, q.dtype, kv_scales[1]).transpose(0, 1).unsqueeze(0)
    return attend(q, k, v, scale, seg.mask, attends.softcap, causal=seg.mask is None)[0].transpose(0, 1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    mask: torch.Tensor | None,
    softcap: float = 0.0,
    causal: bool = False,
) -> torch.Tensor:
    """q [n, H, q, D] over k/v [n, Hkv, k, D] (H a multiple of Hkv), keys seen where `mask` [q, k] is True
    (or causally, aligned to the last key): SDPA, or with a soft-cap the steps of transformers' eager
    attention (scores scaled, capped, masked; float32 softmax)."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        mask = mask.tril(k.shape[2] - q.shape[2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The K or V rows [len(slots), Hkv, D] at these pool slots, in the compute `dtype`."""
    return kv_codec.dequantize(cache.view(-1, *cache.shape[2:]).index_select(0, slots), dtype, scale)
