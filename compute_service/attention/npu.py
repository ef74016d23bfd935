"""Ascend NPU paged attention through torch_npu: K/V written by slot with `_npu_reshape_and_cache`, then
one `npu_fused_infer_attention_score` call per layer over the whole packed step (TND layout, block table;
arguments from compute_service/attention/npu_args.py, built once per step). torch_npu is imported only
when this backend runs (the `npu` extra): selecting it without torch_npu fails with a clear error."""

import importlib

import torch

from compute_service.attention import npu_args
from compute_service.attention.context import layer_call

# The pool dtypes the fused op reads (half precision; fp8/float32 K/V are cpu-only).
KV_DTYPES = ("bfloat16", "float16")
DEVICES = ("npu",)


def require_torch_npu():
    """torch_npu; ValueError naming the fix where it is not installed."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise ValueError(
            f"the npu attention backend needs torch_npu ({exc}): pip install -e '.[npu]' on an Ascend host"
        ) from exc


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
    torch_npu = require_torch_npu()
    ctx, k_cache, v_cache, attends = layer_call(module, attention_mask, kwargs)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    args = ctx.derived.get("npu")
    if args is None:
        scale = scaling if scaling is not None else head_dim**-0.5
        heads = (query.shape[1], num_kv_heads)
        args = ctx.derived["npu"] = npu_args.build_fias_args(
            ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, ctx.slot_mapping, heads, block_size, scale,
            query.device,
        )  # fmt: skip
    torch_npu._npu_reshape_and_cache(
        key=key[0].transpose(0, 1).contiguous(),
        value=value[0].transpose(0, 1).contiguous(),
        key_cache=k_cache,
        value_cache=v_cache,
        slot_indices=args.slot_mapping,
    )
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query[0].transpose(0, 1).contiguous(),
        k_cache.view(num_blocks, block_size, -1),
        v_cache.view(num_blocks, block_size, -1),
        **args.attention_kwargs(attends.window),
    )
    return out.unsqueeze(0), None
