"""CPU paged attention: K/V written by slot, prompts by per-sequence SDPA, decodes by one batched gather."""

import torch
import torch.nn.functional as F

from compute_service.attention.context import DecodeGroup, Segment, get_context


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """Stores key/value [T, Hkv, D] at their pool slots (block_id * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


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
    assert attention_mask is None, "paged attention builds its own masks; the model must not pass one"
    assert kwargs.get("sliding_window") is None and kwargs.get("softcap") is None, "not supported yet"
    ctx = get_context()
    k_cache, v_cache = ctx.k_caches[module.layer_idx], ctx.v_caches[module.layer_idx]
    write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), ctx.slot_mapping)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    if ctx.decode_groups:
        # NOTE: one query select and one output copy per layer; the keys are gathered group by group.
        q = query[0].transpose(0, 1).index_select(0, ctx.decode_tokens).unsqueeze(2)
        outs = [
            _decode(q[g.first : g.first + g.count], k_cache, v_cache, g, scaling) for g in ctx.decode_groups
        ]
        out.index_copy_(0, ctx.decode_tokens, outs[0] if len(outs) == 1 else torch.cat(outs))
    for seg in ctx.segments:
        out[seg.start : seg.end] = _prefill(query, key, value, k_cache, v_cache, seg, scaling)
    return out.unsqueeze(0), None


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float | None
) -> torch.Tensor:
    """q [n, H, 1, D] against the group's gathered keys [n, Hkv, context_len, D] -> [n, H, D]."""
    shape = (len(q), group.context_len, *k_cache.shape[2:])
    k = _gather(k_cache, group.slots).view(shape).transpose(1, 2)
    v = _gather(v_cache, group.slots).view(shape).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[:, :, 0]


def _prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: Segment,
    scale: float | None,
) -> torch.Tensor:
    """One sequence's new queries [1, H, q, D] -> [q, H, D]."""
    q = query[:, :, seg.start : seg.end]
    if seg.slots is None:
        k, v = key[:, :, seg.start : seg.end], value[:, :, seg.start : seg.end]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        k = _gather(k_cache, seg.slots).transpose(0, 1).unsqueeze(0)
        v = _gather(v_cache, seg.slots).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The K or V rows [len(slots), Hkv, D] at these pool slots."""
    return cache.view(-1, *cache.shape[2:]).index_select(0, slots)
