"""A dense, obviously correct paged attention, the yardstick every backend is tested against."""

import torch

from common import paging


def reference_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [T, H, D] of new tokens whose K/V are already in the pool -> [T, H, D], computed in float32;
    a query at position p sees keys (p - window, p] (window 0: all up to p), its scores s soft-capped to
    softcap * tanh(s / softcap) when softcap is not 0."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    groups = query.shape[1] // num_kv_heads
    keys, values = k_cache.reshape(-1, num_kv_heads, head_dim), v_cache.reshape(-1, num_kv_heads, head_dim)
    out = torch.empty_like(query)
    for i, context_len in enumerate(context_lens.tolist()):
        start, end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        slots = paging.slots(block_tables[i], torch.arange(context_len), block_size)
        k = keys[slots].float().repeat_interleave(groups, dim=1)
        v = values[slots].float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        positions = context_len - (end - start) + torch.arange(end - start)[:, None]
        seen = torch.arange(context_len)[None, :]
        visible = (seen <= positions) & (seen > positions - window if window else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out
