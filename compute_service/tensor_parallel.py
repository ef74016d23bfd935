"""Megatron-style tensor parallelism of an unmodified Hugging Face decoder (--tensor-parallel-size N): each
rank keeps 1/N of every layer's attention heads and KV heads (q/k/v projections split by output rows, the
output projection by input columns) and 1/N of its MLP columns (gate/up by rows, down by columns); the two
row-split products end in one all-reduce each, so a layer costs two all-reduces of [tokens, hidden]. A
mixture-of-experts layer splits every expert's MLP columns the same way (and its shared expert's), the router
whole on every rank: each rank's experts sum to its part of the layer's output, the layer still one
all-reduce. A norm over a whole projection (OLMoE's q and k norms, not a head's) adds an all-reduce of each
token's sum of squares. The
embedding and the norms stay whole on every rank (the hidden states after each all-reduce are the same
everywhere); the LM head is split by vocabulary, each rank's part of the logits put together by one
all-gather (measured faster than a head replicated on rank 0: docs/scaling.md). Only rank 0 samples.

transformers' attention modules shape their projections by `-1` heads of head_dim, so a layer of fewer
heads runs unchanged; the paged attention backend sees this rank's heads and this rank's pool.
"""

import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from compute_service.planning import Flags

# The model types whose layers are sharded here: q/k/v/o projections and a gate/up/down MLP, or experts of
# one (transformers' 3-D gate_up_proj and down_proj), the only products that carry heads or MLP columns.
ARCHITECTURES = (
    *("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"),
    *("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"),
)
# The config's sizes of MLP columns, where present: the dense MLP's, each expert's, the shared expert's.
MLP_SIZES = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
COLUMN_ATTENTION = ("q_proj", "k_proj", "v_proj")
COLUMN_MLP = ("gate_proj", "up_proj")
SERVED = f"--tensor-parallel-size serves {', '.join(ARCHITECTURES)} models"


def flags(flags: Flags) -> Flags:
    """The flags a rank loads with: transformers' layer forward on plain linears, whose weights it splits
    (the fused layers and packed kernels would hold the whole ones)."""
    return replace(flags, fused=False, plain_linear=True)


def check_flags(flags: Flags, size: int) -> None:
    """ValueError, in one line naming what is served, unless `size` ranks can split a model under `flags`
    (checked before the flags' own plan, so a refusal names the flag given)."""
    if size == 1:
        return
    if flags.device_type != "cpu":
        raise ValueError(
            f"--tensor-parallel-size {size} on {flags.device}: the ranks run on the cpu (gloo); {SERVED} "
            "with --kv-device cpu"
        )
    if flags.weights not in ("auto", flags.dtype_name):
        raise ValueError(
            f"--tensor-parallel-size {size} with --weights {flags.weights}: {SERVED} in their own dtype "
            "(--weights auto); quantised weights are not split"
        )
    if flags.kv_dtype_name != flags.dtype_name:
        raise ValueError(
            f"--tensor-parallel-size {size} with --kv-dtype {flags.kv_dtype_name}: {SERVED} with K/V stored "
            "in the weights' dtype (--kv-dtype auto)"
        )
    if flags.sparse_attention is not None:
        raise ValueError(
            f"--tensor-parallel-size {size} with --sparse-attention: {SERVED} with dense attention only"
        )


def check_lora(lora: bool, size: int) -> None:
    """ValueError, in one line, for LoRA adapters (--enable-lora, --lora-modules) over `size` > 1 ranks:
    the adapters' products are not split."""
    if lora and size > 1:
        raise ValueError(
            f"--tensor-parallel-size {size} with LoRA adapters (--enable-lora, --lora-modules): {SERVED} "
            "without adapters; serve adapters from one compute (--tensor-parallel-size 1)"
        )


def check(config: PretrainedConfig, size: int) -> None:
    """ValueError, in one line naming what is served, unless `size` ranks can split a model of `config`."""
    if size == 1:
        return
    if config.model_type not in ARCHITECTURES:
        raise ValueError(
            f"--tensor-parallel-size {size}: a {config.model_type} model is not sharded (its fused "
            f"projections are not split); {SERVED}, or run it with --tensor-parallel-size 1"
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    counts = {"attention heads": config.num_attention_heads, "KV heads": kv_heads}
    counts |= {
        f"MLP columns ({name})": getattr(config, name) for name in MLP_SIZES if getattr(config, name, 0)
    }
    for name, count in counts.items():
        if count % size:
            raise ValueError(
                f"--tensor-parallel-size {size}: the model's {name} ({count}) do not split over {size} "
                f"ranks; {SERVED} whose attention heads, KV heads and MLP columns the size divides"
            )


class RowParallel(nn.Module):
    """A linear layer of which this rank holds the input columns of its heads or MLP columns: its partial
    product summed over the group by one all-reduce, the bias added once after it."""

    def __init__(self, linear: nn.Linear, rank: int, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(_input_columns(linear, rank, size), requires_grad=False)
        self.bias = linear.bias
        self.reduce_s = 0.0  # time spent in the all-reduce, summed (tools/ and docs/scaling.md read it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight)
        start = time.perf_counter()
        dist.all_reduce(out)
        self.reduce_s += time.perf_counter() - start
        return out if self.bias is None else out + self.bias


class VocabParallel(nn.Module):
    """The LM head of which this rank holds 1/N of the vocabulary's rows (the last part padded with zero
    rows): each rank multiplies its part, one all-gather puts the logits together on every rank."""

    def __init__(self, head: nn.Linear, rank: int, size: int) -> None:
        super().__init__()
        assert head.bias is None, "a causal LM head without a bias"
        self.in_features, self.out_features, self.size = head.in_features, head.out_features, size
        part = -(-head.out_features // size)
        weight = head.weight.detach()[rank * part : (rank + 1) * part]
        padding = weight.new_zeros(part - len(weight), head.in_features)
        self.weight = nn.Parameter(torch.cat([weight, padding]).contiguous(), requires_grad=False)
        self.reduce_s = 0.0  # time spent in the all-gather, summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mine = nn.functional.linear(x, self.weight).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        start = time.perf_counter()
        dist.all_gather(parts, mine)
        self.reduce_s += time.perf_counter() - start
        return torch.cat(parts, -1)[..., : self.out_features]


def _split_rows(linear: nn.Linear, rank: int, size: int) -> None:
    """Keeps this rank's output rows (its heads or MLP columns) of `linear`, and of its bias."""
    rows = linear.out_features // size
    part = slice(rank * rows, (rank + 1) * rows)
    linear.weight = nn.Parameter(linear.weight.detach()[part].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[part].contiguous(), requires_grad=False)
    linear.out_features = rows


def _split_experts(experts: nn.Module, rank: int, size: int) -> None:
    """Keeps this rank's MLP columns of every expert: its rows of the gate and the up halves of
    gate_up_proj [experts, 2 × columns, hidden], its columns of down_proj [experts, hidden, columns]."""
    columns = experts.intermediate_dim
    part = columns // size
    mine = slice(rank * part, (rank + 1) * part)
    gate, up = experts.gate_up_proj.detach().split(columns, dim=1)
    experts.gate_up_proj = nn.Parameter(
        torch.cat([gate[:, mine], up[:, mine]], 1).contiguous(), requires_grad=False
    )
    experts.down_proj = nn.Parameter(experts.down_proj.detach()[..., mine].contiguous(), requires_grad=False)
    experts.intermediate_dim = part


class ReducedExperts(nn.Module):
    """A mixture-of-experts layer whose experts (and shared expert) hold this rank's MLP columns: its output,
    this rank's part of the layer's, summed over the group by one all-reduce."""

    def __init__(self, block: nn.Module, rank: int, size: int) -> None:
        super().__init__()
        _split_experts(block.experts, rank, size)
        shared = getattr(block, "shared_expert", None)
        if shared is not None:
            for name in COLUMN_MLP:
                _split_rows(getattr(shared, name), rank, size)
            # NOTE: no all-reduce of its own (nor a bias): its part joins the experts' before the layer's.
            down = shared.down_proj
            down.weight = nn.Parameter(_input_columns(down, rank, size), requires_grad=False)
            down.in_features = down.weight.shape[1]
        self.block = block
        self.reduce_s = 0.0  # time spent in the all-reduce, summed

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden_states)
        start = time.perf_counter()
        dist.all_reduce(out)
        self.reduce_s += time.perf_counter() - start
        return out


class SplitNorm(nn.Module):
    """An RMSNorm over a whole projection split by rows (OLMoE's q and k norms span every head): this rank's
    part of its weight, the sum of squares over all the rows by one all-reduce of [tokens, 1]."""

    def __init__(self, norm: nn.Module, rank: int, size: int) -> None:
        super().__init__()
        self.width = norm.weight.numel()
        part = self.width // size
        self.weight = nn.Parameter(
            norm.weight.detach()[rank * part : (rank + 1) * part].contiguous(), requires_grad=False
        )
        self.eps = norm.variance_epsilon
        self.reduce_s = 0.0  # time spent in the all-reduce, summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.float32)
        squares = wide.pow(2).sum(-1, keepdim=True)
        start = time.perf_counter()
        dist.all_reduce(squares)
        self.reduce_s += time.perf_counter() - start
        return self.weight * (wide * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)


def _input_columns(linear: nn.Linear, rank: int, size: int) -> torch.Tensor:
    """This rank's input columns of `linear`'s weight (its heads or MLP columns)."""
    width = linear.in_features // size
    return linear.weight.detach()[:, rank * width : (rank + 1) * width].contiguous()


def shard(model: PreTrainedModel, rank: int, size: int) -> None:
    """Splits every decoder layer of `model` in place to rank `rank` of `size` (check() passed)."""
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for name in COLUMN_ATTENTION:
            _split_rows(getattr(attention, name), rank, size)
        for name, projection in (("q_norm", attention.q_proj), ("k_norm", attention.k_proj)):
            norm = getattr(attention, name, None)
            if norm is not None and norm.weight.numel() == projection.out_features * size:
                setattr(attention, name, SplitNorm(norm, rank, size))
        attention.o_proj = RowParallel(attention.o_proj, rank, size)
        if hasattr(mlp, "experts"):
            layer.mlp = ReducedExperts(mlp, rank, size)
            continue
        for name in COLUMN_MLP:
            _split_rows(getattr(mlp, name), rank, size)
        mlp.down_proj = RowParallel(mlp.down_proj, rank, size)
    model.lm_head = VocabParallel(model.lm_head, rank, size)


def reduce_seconds(model: PreTrainedModel) -> float:
    """The time this rank's all-reduces and the head's all-gathers took so far, summed."""
    parts = (RowParallel, ReducedExperts, SplitNorm, VocabParallel)
    return sum(module.reduce_s for module in model.modules() if isinstance(module, parts))
