"""CUDA paged attention: K/V written by slot, then one varlen kernel call per layer reading K/V in place by
block table: FlashAttention's flash_attn_varlen_func with block_table (and the layer's window_size and
softcap: FlashAttention 2.6 or later) when flash_attn is importable and the step fits it
(compute_service/attention/cuda_args.py flash_usable), else the pure-torch implementation of the same
semantics. On the cpu (--attention-backend cuda --kv-device cpu) it runs that torch path: the way its
argument building is exercised end to end where no GPU is."""

import torch

from compute_service.attention import cuda_args
from compute_service.attention.context import layer_call
from compute_service.attention.cpu import write_kv

# Pool dtypes this backend reads and writes (fp8 needs scaled reads the kernel does not do: cpu only).
KV_DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cuda", "cpu")


def flash_varlen():
    """flash_attn_varlen_func, or None where flash_attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


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
    args = ctx.derived.get("cuda")
    if args is None:
        args = ctx.derived["cuda"] = cuda_args.build_varlen_args(
            ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, ctx.slot_mapping, query.device
        )
    write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), args.slot_mapping)
    q = query[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window_size, flash = cuda_args.flash_window(attends.window), flash_varlen()
    # NOTE: passed only when set, so that a full, uncapped layer runs on FlashAttention before 2.6 too.
    pattern = {"window_size": window_size} if attends.window else {}
    if attends.softcap:
        pattern["softcap"] = attends.softcap
    if flash is not None and cuda_args.flash_usable(q.device, q.dtype, k_cache.dtype, k_cache.shape[1]):
        out = flash(
            q.contiguous(),
            k_cache,
            v_cache,
            cu_seqlens_q=args.cu_seqlens_q,
            cu_seqlens_k=args.cu_seqlens_k,
            max_seqlen_q=args.max_seqlen_q,
            max_seqlen_k=args.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=args.block_table,
            **pattern,
        )
    else:
        out = cuda_args.paged_varlen_attention(q, k_cache, v_cache, args, scale, window_size, attends.softcap)
    return out.unsqueeze(0), None
