"""A lighter forward for Llama-shaped decoder stacks: packed [T, hidden] tensors, fused projections, one
residual stream updated in place, the paged attention function called directly.

Guarantees: the same function as transformers' LlamaModel (or Mistral, Qwen2, Qwen3 model: their QKV biases
ride in the fused projection, their per-head QK RMSNorms are applied here, their sliding windows by the
attention from the config) over the same weights (float rounding aside: the fused products and the rotary
embedding group their operations differently); the attention function is the one the model was loaded with
(compute_service.attention.registry), called as transformers calls it.
"""

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from compute_service.attention.context import get_context


class FusedLlamaLayer(nn.Module):
    """One decoder layer: RMSNorm -> fused QKV (-> RMSNorm of each q and k head, with `head_norms`) -> rotary
    -> paged attention -> o_proj, added to the residual; RMSNorm -> fused gate/up -> SiLU·up -> down_proj,
    added to the residual.

    Its linears are ordinary nn.Linear modules, so later passes over the model's linears (quantising,
    packing) apply to them."""

    def __init__(
        self,
        layer_idx: int,
        shape: tuple[int, int, int],
        norms: tuple[nn.Module, nn.Module],
        linears: tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear],
        attention,
        scaling: float,
        head_norms: tuple[nn.Module, nn.Module] | None = None,
    ) -> None:
        super().__init__()
        # what a transformers attention function may read from its module
        self.layer_idx, self.scaling, self.is_causal = layer_idx, scaling, True
        self.num_heads, self.num_kv_heads, self.head_dim = shape
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.input_layernorm, self.post_attention_layernorm = norms
        self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj = linears
        self.attention = attention
        self.q_norm, self.k_norm = head_norms or (None, None)

    def forward(self, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ops: "RowOps") -> None:
        """Adds this layer's attention and MLP outputs to `residual` [T, hidden], in place, its row-wise ops
        on `ops`."""
        residual.add_(self._attend(ops.rms_norm(residual, self.input_layernorm), rope, ops))
        residual.add_(
            self.down_proj(
                ops.silu_mul(self.gate_up_proj(ops.rms_norm(residual, self.post_attention_layernorm)))
            )
        )

    def _attend(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ops: "RowOps"
    ) -> torch.Tensor:
        tokens, heads, kv_heads = len(x), self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        qk = qkv[:, : (heads + kv_heads) * self.head_dim].reshape(tokens, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = rms_norm(qk[:, :heads], self.q_norm), rms_norm(qk[:, heads:], self.k_norm)
            qk = torch.cat((q, k), dim=1)
        # NOTE: q and k rotated together, [T, H + Hkv, D] in one pass of elementwise ops.
        qk = ops.rotate(qk, *rope)
        v = qkv[:, (heads + kv_heads) * self.head_dim :].reshape(tokens, kv_heads, self.head_dim)
        # transformers' layout: [1, heads, T, D] (views, no copy)
        q, k = qk[:, :heads].transpose(0, 1)[None], qk[:, heads:].transpose(0, 1)[None]
        out, _ = self.attention(self, q, k, v.transpose(0, 1)[None], None, scaling=self.scaling)
        return self.o_proj(out.reshape(tokens, heads * self.head_dim))


class FusedLlamaModel(nn.Module):
    """Stands in for transformers' LlamaModel under the runner: the same call, the same output type."""

    def __init__(self, embed_tokens: nn.Embedding, layers: list[FusedLlamaLayer], norm, rotary_emb) -> None:
        super().__init__()
        self.embed_tokens, self.norm, self.rotary_emb = embed_tokens, norm, rotary_emb
        self.layers = nn.ModuleList(layers)
        # The C++ stack for all-decode steps (compute_service.native_decode), and the row-wise ops of the
        # other steps: the loader sets both where the execution plan runs the stack.
        self.native_decode = None
        self.row_ops = TORCH_ROW_OPS

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **_ignored,
    ) -> BaseModelOutputWithPast:
        """input_ids, position_ids [1, T] (or inputs_embeds [1, T, hidden] in place of input_ids) ->
        last_hidden_state [1, T, hidden]; keyword arguments transformers' model takes (use_cache) are accepted
        and have no effect here."""
        residual = self.embed_tokens(input_ids[0]) if inputs_embeds is None else inputs_embeds[0]
        assert position_ids.shape == (1, len(residual)), "one packed row"
        cos, sin = self.rotary_emb(residual[None], position_ids)
        rope = rope_tables(cos[0], sin[0])
        ctx = get_context() if self.native_decode is not None else None
        if ctx is not None and self.native_decode.serves(ctx):
            self.native_decode.run(residual, rope, ctx)
        else:
            for layer in self.layers:
                layer(residual, rope, self.row_ops)
        return BaseModelOutputWithPast(last_hidden_state=self.row_ops.rms_norm(residual, self.norm)[None])


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' LlamaRMSNorm with its float32 arithmetic in the same order (float32 inputs only: see
    compute_service.fused), its temporaries updated in place.

    NOTE: not F.rms_norm: on the CPU its kernel was no faster than transformers' six ops from 64 rows on and
    slower than this one (docs/internals/kernels.md)."""
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True).add_(norm.variance_epsilon))
    return (x * rstd).mul_(norm.weight)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] -> [T, 1, D] each, sin's first half negated, as `rotate` takes them."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos[:, None], signed[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding of x [T, heads, D]: x·cos + rotate_half(x)·sin, where rotate_half(x)·sin
    = roll(x, D/2)·(-sin₁, sin₂)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of gate_up [T, 2 · intermediate] (the fused gate/up product's output)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


@dataclass(frozen=True)
class RowOps:
    """A layer's row-wise ops on float32 [T, ...] tensors: rms_norm(x, norm), rotate(x [T, heads, D], cos,
    signed_sin) (which may rotate x in place) and silu_mul(gate_up)."""

    rms_norm: Callable[[torch.Tensor, nn.Module], torch.Tensor]
    rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


TORCH_ROW_OPS = RowOps(rms_norm, rotate, silu_mul)


def native_row_ops(module: ModuleType) -> RowOps:
    """The native decoder stack's own RMSNorm, rotary and SiLU·up (compute_service/kernels/decode_layers.cpp)
    over any row count: each one pass over the rows, split across torch's threads, where torch's take three
    to six ops (measured in docs/internals/cpu-fast-path.md)."""

    def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        module.rotate_rows(x, cos, signed_sin)
        return x

    return RowOps(
        lambda x, norm: module.rms_norm_rows(x, norm.weight, norm.variance_epsilon),
        rotate_in_place,
        module.silu_mul_rows,
    )
