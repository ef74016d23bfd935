"""The fused Llama stack's all-decode steps in C++ (compute_service/kernels/decode_layers.cpp).

A decode step of a small model is mostly small ops: per layer ~25 of them (two RMSNorms, the rotary
embedding, the K/V store, the residual adds, SiLU, views) around four matrix products and attention, each
costing Python dispatch. The native stack runs the same function with no Python between the ops: the
products are the same kernels on the same packed weights (compute_service.linear, or the int8 panels of
compute_service.quantized), attention is the same cpu-native kernel (compute_service.attention.cpu_native),
the rest plain loops.

Where it runs (`NativeDecode.serves`): a FusedLlamaModel whose linears are all packed (or all int8 panels)
and bias-free, loaded with the cpu-native attention on a float32 or bfloat16 pool, in a step where every
sequence decodes one token. Any other step (a prompt or a chunk in the batch) runs the Python layers.
"""

import torch

from compute_service import kernels
from compute_service.attention import cpu_native
from compute_service.attention.context import Context
from compute_service.linear import PackedLinear
from compute_service.llama_layer import FusedLlamaLayer, FusedLlamaModel
from compute_service.quantized import QuantizedLinear

BACKEND = "cpu-native"
# The pools the native stack stores K/V into (decode_layers.cpp's `store`).
POOL_DTYPES = (torch.float32, torch.bfloat16)


def _linears(layer: FusedLlamaLayer) -> tuple:
    return layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj


def _int8_panels(linear: torch.nn.Module) -> bool:
    return type(linear) is QuantizedLinear and linear.panels


class NativeDecode:
    """The weights of a fused stack as the native decode_layers call takes them (six tensors per layer), and
    the scales of its four products per layer when they are int8 panels (else none)."""

    def __init__(self, layers: list[FusedLlamaLayer]) -> None:
        first = layers[0]
        self.num_heads, self.num_kv_heads, self.scale = first.num_heads, first.num_kv_heads, first.scaling
        self.eps = first.input_layernorm.variance_epsilon
        self.weights = [
            tensor
            for layer in layers
            for tensor in (
                layer.input_layernorm.weight.detach(),
                _weight(layer.qkv_proj),
                _weight(layer.o_proj),
                layer.post_attention_layernorm.weight.detach(),
                _weight(layer.gate_up_proj),
                _weight(layer.down_proj),
            )
        ]
        int8 = _int8_panels(first.qkv_proj)
        self.scales = [linear.scales for layer in layers for linear in _linears(layer)] if int8 else []

    @staticmethod
    def fits(layers: list[FusedLlamaLayer], attn_implementation: str) -> bool:
        """Whether these layers can run natively: all their linears packed, or all int8 panels, and
        bias-free; the same shape and norm epsilon in every layer, float32 norms, the cpu-native attention,
        and the kernel built here."""
        linears = [linear for layer in layers for linear in _linears(layer)]
        norms = [norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        first = layers[0]
        return (
            attn_implementation == f"pagedserve_{BACKEND}"
            and (all(type(lin) is PackedLinear for lin in linears) or all(map(_int8_panels, linears)))
            and all(lin.bias is None for lin in linears)
            and all(norm.weight.dtype == torch.float32 for norm in norms)
            and len({norm.variance_epsilon for norm in norms}) == 1
            and all(
                (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling)
                == (first.num_heads, first.num_kv_heads, first.head_dim, first.scaling)
                for layer in layers
            )
            and kernels.load() is not None
        )

    @staticmethod
    def serves(ctx: Context) -> bool:
        """Whether this step can run natively: every sequence decodes one token, on a float32 or bfloat16
        pool (fp8 ones have scales the stack does not apply)."""
        return not ctx.prompt_rows and ctx.k_caches[0].dtype in POOL_DTYPES

    def run(self, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: Context) -> None:
        """Every layer over residual [T, hidden] in place (see decode_layers.cpp); attention's time is added
        to the step's."""
        cos, signed_sin = (table[:, 0].contiguous() for table in rope)
        inputs = cpu_native.kernel_inputs(ctx)
        ctx.attention_s += kernels.load().decode_layers(
            residual,
            cos,
            signed_sin,
            self.weights,
            self.scales,
            ctx.k_caches,
            ctx.v_caches,
            ctx.slot_mapping.contiguous(),
            inputs.block_tables,
            inputs.q_starts,
            inputs.q_lens,
            inputs.context_lens,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
        )


def _weight(linear: torch.nn.Module) -> torch.Tensor:
    """A product's weight as packed: PackedLinear's `packed`, or QuantizedLinear's int8 panels."""
    return linear.qweight if type(linear) is QuantizedLinear else linear.packed


def enable(model: torch.nn.Module) -> bool:
    """Gives a loaded model's FusedLlamaModel its NativeDecode if its layers fit (run after packing); returns
    whether it did."""
    base = getattr(model, "model", None)
    if not isinstance(base, FusedLlamaModel):
        return False
    layers = list(base.layers)
    if not NativeDecode.fits(layers, model.config._attn_implementation):
        return False
    base.native_decode = NativeDecode(layers)
    return True
