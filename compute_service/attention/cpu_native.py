"""CPU paged attention reading K/V in place by block table (compute_service/kernels): no gather copy.

Every sequence of a step, decodes and prompt chunks alike, goes to the native kernel in one call per layer,
with an online softmax in float32 over the pool's own dtype (fp8 scales folded into the query and the
output), the layer's sliding window and soft-cap applied in the kernel. Under --sparse-attention a long
decode's table is first cut down to the blocks it attends to (compute_service.attention.sparse).

NOTE: prompts and chunks go to the kernel too, not to the pure-torch backend's gather + SDPA
(compute_service.attention.cpu): since it scores four query rows per key vector, weighs values two rows at a
time and hands out items of up to 32 queries costliest first, it takes about half the time of gather + SDPA
on fresh prompts and less on chunks over a cached prefix (docs/internals/native-attention.md).
"""

from dataclasses import dataclass

import torch

from compute_service import kernels
from compute_service.attention import cpu
from compute_service.attention.context import Context, layer_call

KV_DTYPES = cpu.KV_DTYPES


@dataclass(frozen=True, slots=True)
class KernelInputs:
    """The step's sequences as the kernel takes them (int64, contiguous)."""

    q_starts: torch.Tensor  # [N] first new token of each, in the packed batch
    q_lens: torch.Tensor  # [N]
    context_lens: torch.Tensor  # [N]
    block_tables: torch.Tensor  # [N, W]


def kernel():
    """The compiled kernel module; RuntimeError naming the fallback when this machine cannot build it."""
    module = kernels.load()
    if module is None:
        raise RuntimeError("the native attention kernel cannot be built here; use --attention-backend cpu")
    return module


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
    cpu.write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), ctx.slot_mapping, scales)
    inputs = kernel_inputs(ctx)
    queries, scale = query[0].transpose(0, 1), query.shape[3] ** -0.5 if scaling is None else scaling
    tables, context_lens = inputs.block_tables, inputs.context_lens
    if ctx.sparse is not None and not attends.window:
        # the stored keys' scores, as the kernel takes them: q . k * scale * k_scale
        tables, context_lens = ctx.sparse.tables(
            module.layer_idx, queries, scale * scales[0], inputs.q_starts, inputs.q_lens, context_lens, tables
        )
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    kernel().paged_attention(
        queries,
        out,
        k_cache,
        v_cache,
        tables,
        inputs.q_starts,
        inputs.q_lens,
        context_lens,
        scale,
        *scales,
        attends.window,
        attends.softcap,
    )
    return out.unsqueeze(0), None


def kernel_inputs(ctx: Context) -> KernelInputs:
    """This step's inputs, derived by the first layer and shared by the others."""
    inputs = ctx.derived.get(__name__)
    if inputs is None:
        inputs = ctx.derived[__name__] = _kernel_inputs(ctx)
    assert isinstance(inputs, KernelInputs)
    return inputs


def _kernel_inputs(ctx: Context) -> KernelInputs:
    cu = ctx.cu_seqlens_q
    return KernelInputs(
        q_starts=cu[:-1].long().contiguous(),
        q_lens=cu.diff().long(),
        context_lens=ctx.context_lens.long().contiguous(),
        block_tables=ctx.block_tables.long().contiguous(),
    )
