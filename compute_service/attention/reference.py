"""A dense, obviously correct paged attention, the yardstick every backend is tested against."""

import torch

from common import paging
from common.sparse_settings import SparseAttention


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
    sparse: SparseAttention | list[SparseAttention | None] | None = None,
) -> torch.Tensor:
    """query [T, H, D] of new tokens whose K/V are already in the pool -> [T, H, D], computed in float32;
    a query at position p sees keys (p - window, p] (window 0: all up to p), its scores s soft-capped to
    softcap * tanh(s / softcap) when softcap is not 0; with `sparse` (and no window; one for every sequence,
    or a list of one per sequence, None: dense), a decode of more blocks than its budget sees only the keys
    of the blocks `sparse_blocks` chooses."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    groups = query.shape[1] // num_kv_heads
    keys, values = k_cache.reshape(-1, num_kv_heads, head_dim), v_cache.reshape(-1, num_kv_heads, head_dim)
    out = torch.empty_like(query)
    rows = sparse if isinstance(sparse, list) else [sparse] * len(context_lens)
    for i, context_len in enumerate(context_lens.tolist()):
        sparse = rows[i]
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
        num_blocks = paging.blocks_for(context_len, block_size)
        if sparse is not None and not window and end - start == 1 and num_blocks > sparse.budget:
            chosen = sparse_blocks(sparse, query[start].float(), scale, keys[slots], block_size, groups)
            visible &= torch.isin(seen // block_size, torch.tensor(chosen))
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def sparse_blocks(
    sparse: SparseAttention,
    query: torch.Tensor,
    scale: float,
    keys: torch.Tensor,
    block_size: int,
    groups: int,
) -> list[int]:
    """The table positions a decode (query [H, D], scores q . k * scale) over a context of `keys`
    [n, Hkv, D] attends to: the first sparse.sink, the last sparse.recent and the sparse.topk between with
    the highest score, a block's score being log sum over the heads of exp(scale * (its bound - the head's
    best bound among those blocks)), a head's bound the most q . k can be over the block's element-wise key
    minima and maxima."""
    num_blocks = paging.blocks_for(len(keys), block_size)
    between = range(sparse.sink, num_blocks - sparse.recent)
    bounds = []
    for block in between:
        block_keys = keys[block * block_size : (block + 1) * block_size].float()
        low = block_keys.amin(0).repeat_interleave(groups, dim=0)
        high = block_keys.amax(0).repeat_interleave(groups, dim=0)
        bounds.append(torch.where(query >= 0, query * high, query * low).sum(-1))
    per_head = torch.stack(bounds)  # [blocks between, H]
    scores = ((per_head - per_head.amax(0)) * scale).logsumexp(1).tolist()
    best = sorted(range(len(between)), key=lambda i: scores[i], reverse=True)[: sparse.topk]
    recent = range(num_blocks - sparse.recent, num_blocks)
    return [*range(sparse.sink), *sorted(between[i] for i in best), *recent]
