"""The fused Llama-shaped stack's all-decode steps in C++ (compute_service/kernels/decode_layers.cpp): Llama,
Mistral, Qwen2 (QKV biases) and Qwen3 (per-head QK RMSNorm), the architectures in ARCHITECTURES.

A decode step of a small model is mostly small ops: per layer ~25 of them (two RMSNorms, the rotary
embedding, the K/V store, the residual adds, SiLU, views) around four matrix products and attention, each
costing Python dispatch. The native stack runs the same function with no Python between the ops: the
products are the same kernels on the same packed weights (compute_service.linear_kernels: float32 or int8
panels, oneDNN in bfloat16), attention is the same cpu-native kernel (compute_service.attention.cpu_native),
the rest plain loops. It pays at every batch size measured, float32, int8 and bfloat16 weights alike
(docs/internals/execution-plan.md; `python -m tests.step_bench --compare decode-stack` measures it again).

Where it runs is the execution plan's choice (compute_service.planning: fused layers of an architecture in
ARCHITECTURES, each layer over its own sliding window and its KV group's tables, the cpu-native attention,
panel or oneDNN linears, with or without biases, a float32 or bfloat16 pool); in a step where every
sequence decodes one token. Any other step (a prompt or a chunk in the batch) runs the Python layers. The
biases are the layers' own (Qwen2's on q/k/v; Llama's attention_bias and mlp_bias), added as the Linear's
kernel adds them; the head norms are applied to each query and key head after the QKV product, before the
rotary embedding, with the layers' RMSNorm epsilon, as FusedLlamaLayer applies them. Block-sparse rows
(compute_service.attention.sparse) decode inside it too: the step's selecting rows and their summaries are
derived here once, and each full-attention layer's tables are cut down in C++ (sparse_select.cpp) before its
attention.
"""

import torch

from compute_service import kernels
from compute_service.attention import cpu_native
from compute_service.attention.context import Context
from compute_service.linear import Linear
from compute_service.linear_kernels import OneDnn, Panels
from compute_service.llama_layer import FusedLlamaLayer
from compute_service.lora.layers import current_rows

# The architectures (transformers model_type) whose fused layers decode_layers.cpp computes: every one the
# fused forward rebuilds (compute_service.fused.ARCHITECTURES).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def _linears(layer: FusedLlamaLayer) -> tuple:
    return layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj


def _kernel(linear: torch.nn.Module) -> Panels | OneDnn:
    """A product's kernel, as the plan made it (compute_service.planning.decode_layers)."""
    assert isinstance(linear, Linear) and isinstance(linear.kernel, (Panels, OneDnn))
    return linear.kernel


def _bias(linear: torch.nn.Module) -> torch.Tensor:
    """A product's bias as decode_layers takes it: an empty tensor for none."""
    bias = linear.bias
    return torch.empty(0) if bias is None else bias.detach().float().contiguous()


class NativeDecode:
    """The weights of a fused stack as the native decode_layers call takes them (six tensors per layer), the
    scales of its four products per layer when they are int8 panels (else none), their biases (four per
    layer, empty tensors for none; none at all when no layer has one) and the q and k head norms' weights
    (two per layer, where the layers have them)."""

    def __init__(self, layers: list[FusedLlamaLayer], windows: tuple[int, ...]) -> None:
        self.windows = list(windows)
        first = layers[0]
        self.num_heads, self.num_kv_heads, self.scale = first.num_heads, first.num_kv_heads, first.scaling
        # NOTE: one epsilon for every norm: transformers builds the head norms with the config's rms_norm_eps,
        # as the layer norms.
        self.eps = first.input_layernorm.variance_epsilon
        self.weights = [
            tensor
            for layer in layers
            for tensor in (
                layer.input_layernorm.weight.detach(),
                _kernel(layer.qkv_proj).packed,
                _kernel(layer.o_proj).packed,
                layer.post_attention_layernorm.weight.detach(),
                _kernel(layer.gate_up_proj).packed,
                _kernel(layer.down_proj).packed,
            )
        ]
        scales = [getattr(_kernel(linear), "scales", None) for layer in layers for linear in _linears(layer)]
        self.scales = [] if scales[0] is None else scales
        biases = [_bias(linear) for layer in layers for linear in _linears(layer)]
        self.biases = biases if any(bias.numel() for bias in biases) else []
        self.head_norms = [
            norm.weight.detach().float().contiguous()
            for layer in layers
            if layer.q_norm is not None
            for norm in (layer.q_norm, layer.k_norm)
        ]

    @staticmethod
    def serves(ctx: Context) -> bool:
        """Whether this step runs natively: every sequence decodes one token, none through a LoRA adapter
        (adapter rows run the fused layers, compute_service.lora)."""
        return not ctx.prompt_rows and current_rows() is None

    def run(self, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: Context) -> None:
        """Every layer over residual [T, hidden] in place (see decode_layers.cpp), each by its KV group's
        slots and tables; attention's time is added to the step's."""
        cos, signed_sin = (table[:, 0].contiguous() for table in rope)
        groups = ctx.groups or (ctx,)
        tables = [cpu_native.kernel_inputs(group).block_tables for group in groups]
        inputs = cpu_native.kernel_inputs(ctx)
        bounds, settings = self._sparse(ctx, inputs)
        ctx.attention_s += kernels.load().decode_layers(
            residual,
            cos,
            signed_sin,
            self.weights,
            self.scales,
            self.biases,
            self.head_norms,
            ctx.k_caches,
            ctx.v_caches,
            [group.slot_mapping.contiguous() for group in groups],
            tables,
            list(ctx.layer_groups),
            inputs.q_starts,
            inputs.q_lens,
            inputs.context_lens,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
            self.windows,
            bounds,
            settings,
        )

    def _sparse(
        self, ctx: Context, inputs: cpu_native.KernelInputs
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Each layer's block summaries (empty: dense) and the rows' settings, or none when no row selects."""
        sparse = ctx.sparse
        sel = (
            None
            if sparse is None
            else sparse.selection(inputs.q_lens, inputs.context_lens, inputs.block_tables)
        )
        if sel is None:
            return [], None
        summaries, empty = sparse.summaries, torch.empty(0)
        layers = range(len(self.windows))
        return [summaries.of_layer(i) if summaries.has(i) else empty for i in layers], sel.settings
