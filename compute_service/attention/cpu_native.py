"""CPU paged attention reading K/V in place by block table (compute_service/attention/native): no gather copy.

Decodes go to the native kernel in one call per layer, with an online softmax in float32 over the pool's own
dtype (fp8 scales folded into the query and the output). Prompts and prompt chunks keep the SDPA of the
pure-torch backend (compute_service.attention.cpu).

NOTE: the kernel attends prompt chunks over a cached prefix too (its tests check them). On 2 threads it
measured a little ahead of gather + SDPA up to ~16 new tokens, even to ~48 and behind at 64 (SDPA's matrix
products catch up once a key serves many queries; README, Native paged attention), so only decodes are
routed to it.
"""

from dataclasses import dataclass

import torch

from compute_service.attention import cpu, native
from compute_service.attention.context import Context, Segment, layer_call

KV_DTYPES = cpu.KV_DTYPES


@dataclass(frozen=True, slots=True)
class Plan:
    """The decodes the kernel attends this step (int64, contiguous), and the prompts SDPA attends."""

    q_starts: torch.Tensor  # [n] first new token of each, in the packed batch
    q_lens: torch.Tensor  # [n]
    context_lens: torch.Tensor  # [n]
    block_tables: torch.Tensor  # [n, W]
    prompts: list[Segment]


def kernel():
    """The compiled kernel module; RuntimeError naming the fallback when this machine cannot build it."""
    module = native.load()
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
    ctx, k_cache, v_cache = layer_call(module, attention_mask, kwargs)
    scales = ctx.scales.of_layer(module.layer_idx)
    cpu.write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), ctx.slot_mapping, scales)
    plan = step_plan(ctx)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    if len(plan.q_lens):
        scale = query.shape[3] ** -0.5 if scaling is None else scaling
        kernel().paged_attention(
            query[0].transpose(0, 1),
            out,
            k_cache,
            v_cache,
            plan.block_tables,
            plan.q_starts,
            plan.q_lens,
            plan.context_lens,
            scale,
            *scales,
        )
    for seg in plan.prompts:
        out[seg.start : seg.end] = cpu.prefill(query, key, value, k_cache, v_cache, seg, scaling, scales)
    return out.unsqueeze(0), None


def step_plan(ctx: Context) -> Plan:
    """This step's plan, derived by the first layer and shared by the others."""
    plan = ctx.plans.get(__name__)
    if plan is None:
        plan = ctx.plans[__name__] = _plan(ctx)
    assert isinstance(plan, Plan)
    return plan


def _plan(ctx: Context) -> Plan:
    q_lens = ctx.cu_seqlens_q.diff()
    rows = (q_lens == 1).nonzero().squeeze(1)
    return Plan(
        q_starts=ctx.cu_seqlens_q[rows].long().contiguous(),
        q_lens=q_lens[rows].long().contiguous(),
        context_lens=ctx.context_lens[rows].long().contiguous(),
        block_tables=ctx.block_tables[rows].long().contiguous(),
        prompts=ctx.segments,
    )
