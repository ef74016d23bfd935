"""Megatron-style tensor parallelism of an unmodified Hugging Face decoder (--tensor-parallel-size N): each
rank keeps 1/N of every layer's attention heads and KV heads (q/k/v projections split by output rows, the
output projection by input columns) and 1/N of its MLP columns (gate/up by rows, down by columns); the two
row-split products end in one all-reduce each, so a layer costs two all-reduces of [tokens, hidden]. The
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

# The model types whose layers are sharded here: q/k/v/o projections and a gate/up/down MLP, the only
# products that carry heads or MLP columns.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
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
            f"--tensor-parallel-size {size}: a {config.model_type} model is not sharded (its experts or "
            f"fused projections are not split); {SERVED}, or run it with --tensor-parallel-size 1"
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    counts = {
        "attention heads": config.num_attention_heads,
        "KV heads": kv_heads,
        "MLP columns": config.intermediate_size,
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
        width = linear.in_features // size
        weight = linear.weight.detach()[:, rank * width : (rank + 1) * width].contiguous()
        self.weight = nn.Parameter(weight, requires_grad=False)
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


def shard(model: PreTrainedModel, rank: int, size: int) -> None:
    """Splits every decoder layer of `model` in place to rank `rank` of `size` (check() passed)."""
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for name in COLUMN_ATTENTION:
            _split_rows(getattr(attention, name), rank, size)
        for name in COLUMN_MLP:
            _split_rows(getattr(mlp, name), rank, size)
        attention.o_proj = RowParallel(attention.o_proj, rank, size)
        mlp.down_proj = RowParallel(mlp.down_proj, rank, size)
    model.lm_head = VocabParallel(model.lm_head, rank, size)


def reduce_seconds(model: PreTrainedModel) -> float:
    """The time this rank's all-reduces and the head's all-gathers took so far, summed."""
    parts = (RowParallel, VocabParallel)
    return sum(module.reduce_s for module in model.modules() if isinstance(module, parts))
