"""The CUDA backend's per-step kernel arguments, built from a step's packed metadata without touching CUDA,
and a pure-torch implementation of the kernel's documented semantics: FlashAttention's
`flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
softmax_scale, causal=True, window_size, softcap, block_table)`. That implementation is the CPU check of
the arguments (it must equal the cpu backend on the same batch) and the CUDA backend's fallback where
flash_attn is missing."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compute_service.attention.cpu import attend

# flash_attn_varlen_func's paged KV needs pages of a multiple of 256 tokens (FlashAttention 2).
FLASH_BLOCK_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VarlenArgs:
    """What every layer of a step passes to the kernel (tensors on the step's device)."""

    cu_seqlens_q: torch.Tensor  # int32 [N + 1] offsets of each sequence's new tokens in the packed batch
    cu_seqlens_k: torch.Tensor  # int32 [N + 1] cumulative context lengths (cached + new keys)
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # int32 [N, W], padding 0 (never read: past each sequence's keys)
    slot_mapping: torch.Tensor  # int64 [T] pool slot each new token's K/V are written to


def build_varlen_args(
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    device: torch.device | str = "cpu",
) -> VarlenArgs:
    """The arguments for a checked step (compute_service/batch.py): its cu_seqlens_q, context_lens,
    -1 padded block tables and slot mapping."""
    assert len(cu_seqlens_q) == len(context_lens) + 1 == len(block_tables) + 1
    cu_seqlens_k = F.pad(context_lens.cumsum(0), (1, 0))
    return VarlenArgs(
        cu_seqlens_q=cu_seqlens_q.to(device, torch.int32),
        cu_seqlens_k=cu_seqlens_k.to(device, torch.int32),
        max_seqlen_q=int(cu_seqlens_q.diff().max()),
        max_seqlen_k=int(context_lens.max()),
        block_table=block_tables.clamp(min=0).to(device, torch.int32),
        slot_mapping=slot_mapping.to(device, torch.int64),
    )


def flash_usable(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int) -> bool:
    """Whether flash_attn_varlen_func can run this step: on CUDA, half-precision queries over a pool in the
    same dtype, pages of a multiple of FLASH_BLOCK_MULTIPLE tokens."""
    return (
        device.type == "cuda"
        and dtype in FLASH_DTYPES
        and kv_dtype == dtype
        and block_size % FLASH_BLOCK_MULTIPLE == 0
    )


def flash_window(window: int) -> tuple[int, int]:
    """flash_attn's window_size (keys left and right of a query's diagonal) for a layer whose query at p sees
    keys (p - window, p]; (-1, -1), no window, for full attention."""
    return (window - 1, 0) if window else (-1, -1)


def paged_varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    args: VarlenArgs,
    scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """flash_attn_varlen_func's result with a paged KV cache: q [T, H, D] packed by cu_seqlens_q; sequence
    i's keys are the first cu_seqlens_k[i + 1] - cu_seqlens_k[i] tokens of its pages block_table[i] in
    k_cache/v_cache [blocks, block_size, Hkv, D]; causal aligned to the bottom right (query j of q_len sees
    keys up to k_len - q_len + j), and with window_size (left, right) not -1 only keys from k_len - q_len +
    j - left; scores (scaled) become softcap * tanh(score / softcap) when softcap is not 0; H / Hkv query
    heads share a KV head. Returns [T, H, D]."""
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    q_offsets, k_offsets = args.cu_seqlens_q.tolist(), args.cu_seqlens_k.tolist()
    left = window_size[0]
    for i in range(len(q_offsets) - 1):
        start, end = q_offsets[i], q_offsets[i + 1]
        k_len = k_offsets[i + 1] - k_offsets[i]
        pages = args.block_table[i, : -(-k_len // block_size)].long()
        k = k_cache[pages].flatten(0, 1)[:k_len].to(q.dtype).transpose(0, 1)[None]
        v = v_cache[pages].flatten(0, 1)[:k_len].to(q.dtype).transpose(0, 1)[None]
        q_len = end - start
        diagonal = k_len - q_len + torch.arange(q_len, device=q.device)[:, None]
        keys = torch.arange(k_len, device=q.device)[None, :]
        visible = (keys <= diagonal) & (keys >= diagonal - left if left >= 0 else True)
        o = attend(q[start:end].transpose(0, 1)[None], k, v, scale, visible, softcap)
        out[start:end] = o[0].transpose(0, 1)
    return out
