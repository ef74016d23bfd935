"""CPU paged attention: K/V written by slot, prompts by per-sequence SDPA, decodes by one batched gather.

K/V are stored in the pool's dtype and read back in the compute dtype (compute_service.attention.kv_codec).
"""

import torch
import torch.nn.functional as F

from compute_service.attention import kv_codec
from compute_service.attention.context import DecodeGroup, Segment, layer_call

# The pool dtypes this backend reads and writes (common/shared_pool.py DTYPES: all of them).
KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")


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
    ctx, k_cache, v_cache = layer_call(module, attention_mask, kwargs)
    scales = ctx.scales.of_layer(module.layer_idx)
    write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), ctx.slot_mapping, scales)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    if ctx.decode_groups:
        # NOTE: one query select and one output copy per layer; the keys are gathered group by group.
        q = query[0].transpose(0, 1).index_select(0, ctx.decode_tokens).unsqueeze(2)
        outs = [
            _decode(q[g.first : g.first + g.count], k_cache, v_cache, g, scaling, scales)
            for g in ctx.decode_groups
        ]
        out.index_copy_(0, ctx.decode_tokens, outs[0] if len(outs) == 1 else torch.cat(outs))
    for seg in ctx.segments:
        out[seg.start : seg.end] = prefill(query, key, value, k_cache, v_cache, seg, scaling, scales)
    return out.unsqueeze(0), None


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float | None,
    kv_scales: tuple[float, float],
) -> torch.Tensor:
    """q [n, H, 1, D] against the group's gathered keys [n, Hkv, context_len, D] -> [n, H, D]."""
    shape = (len(q), group.context_len, *k_cache.shape[2:])
    k = _gather(k_cache, group.slots, q.dtype, kv_scales[0]).view(shape).transpose(1, 2)
    v = _gather(v_cache, group.slots, q.dtype, kv_scales[1]).view(shape).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[:, :, 0]


def prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: Segment,
    scale: float | None,
    kv_scales: tuple[float, float],
) -> torch.Tensor:
    """One sequence's new queries [1, H, q, D] -> [q, H, D]."""
    q = query[:, :, seg.start : seg.end]
    if seg.slots is None:
        # NOTE: the new keys as the pool holds them, so a prompt attends over the same K/V whether its
        # prefix was cached or computed in this step.
        k = kv_codec.round_trip(key[:, :, seg.start : seg.end], k_cache.dtype, kv_scales[0])
        v = kv_codec.round_trip(value[:, :, seg.start : seg.end], v_cache.dtype, kv_scales[1])
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        k = _gather(k_cache, seg.slots, q.dtype, kv_scales[0]).transpose(0, 1).unsqueeze(0)
        v = _gather(v_cache, seg.slots, q.dtype, kv_scales[1]).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The K or V rows [len(slots), Hkv, D] at these pool slots, in the compute `dtype`."""
    return kv_codec.dequantize(cache.view(-1, *cache.shape[2:]).index_select(0, slots), dtype, scale)
