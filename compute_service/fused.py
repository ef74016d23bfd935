"""Fewer, larger ops: a loaded model rebuilt on a lighter layer forward (compute_service.llama_layer), for the
architectures in ARCHITECTURES: Llama and the stacks whose layers are Llama's up to what the fused layer does
as well (Mistral: sliding windows, which the attention reads from the config; Qwen2: QKV biases, carried by
the fused projection; Qwen3: an RMSNorm over each query and key head).

q/k/v become one linear (their weights stacked, the output split after), gate/up another; the residual
stream is one tensor updated in place and the RMSNorms work on their temporaries in place; the per-layer
forward calls the paged attention function directly, with none of transformers' kwargs plumbing, mask
creation or output capture.

Which models (`misfit`, asked by the execution plan: compute_service.planning): an architecture listed in
ARCHITECTURES whose config its check accepts, in float32. Others keep transformers' own forward. NOTE:
float32 only, because bfloat16 parity with transformers is held token for token, and transformers computes
RMSNorm in float32 and rounds to bfloat16 before the weight product, which this forward (all in the input's
dtype) does not reproduce.

A new architecture plugs in with an entry in ARCHITECTURES: its config check and the function that rebuilds
a loaded model of it; the plan then reports it, and every architecture not listed is reported as running
transformers' layers, with the list of those that do not.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer, MistralModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2Model
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3Model

from compute_service.llama_layer import FusedLlamaLayer, FusedLlamaModel


@dataclass(frozen=True)
class Architecture:
    """A fused forward for one transformers model_type: `misfit(config)` says why a config of it does not
    fit (None: it does), `rebuild(model)` replaces a loaded model's stack in place."""

    misfit: Callable[[PretrainedConfig], str | None]
    rebuild: Callable[[PreTrainedModel], None]


def misfit(config: PretrainedConfig, dtype: torch.dtype) -> str | None:
    """Why a model of `config` in `dtype` keeps transformers' layers, or None if `fuse` rebuilds it."""
    architecture = ARCHITECTURES.get(config.model_type)
    if architecture is None:
        layers = UNFUSED_LAYERS.get(config.model_type, f"{config.model_type} layers")
        return f"{layers}: the fused forward supports {', '.join(ARCHITECTURES)} only"
    if dtype != torch.float32:
        return "the fused forward runs float32 only (bfloat16 parity rounds RMSNorm as transformers does)"
    return architecture.misfit(config)


def fuse(model: PreTrainedModel) -> None:
    """Rebuilds `model` in place on its architecture's fused forward (the plan chose it: `misfit` is None)."""
    assert _is_paged(model.config._attn_implementation), "the fused stack keeps no KV cache of its own"
    ARCHITECTURES[model.config.model_type].rebuild(model)


def _is_paged(attn_implementation: str) -> bool:
    """A paged attention function (compute_service.model_loader.register_attention): the fused stack keeps no
    KV cache of its own, so any other attention would see only the step's new tokens."""
    return attn_implementation.startswith("pagedserve_") and attn_implementation in ALL_ATTENTION_FUNCTIONS


def _llama_misfit(config: PretrainedConfig) -> str | None:
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act!r}: the fused Llama MLP is SiLU-gated"
    return None


def _rebuild_llama(model: PreTrainedModel) -> None:
    """`model.model` replaced by a FusedLlamaModel over the same weights; the embedding stays shared with a
    tied output head."""
    base = model.model
    layer_class = LLAMA_SHAPED[type(base)]
    assert all(type(layer) is layer_class for layer in base.layers)
    attention = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    layers = [fused_layer(layer, attention) for layer in base.layers]
    model.model = FusedLlamaModel(base.embed_tokens, layers, base.norm, base.rotary_emb)


def fused_layer(layer: LlamaDecoderLayer, attention) -> FusedLlamaLayer:
    attn, mlp = layer.self_attn, layer.mlp
    config = attn.config
    shape = (config.num_attention_heads, config.num_key_value_heads, attn.head_dim)
    linears = (
        stacked(attn.q_proj, attn.k_proj, attn.v_proj),
        attn.o_proj,
        stacked(mlp.gate_proj, mlp.up_proj),
        mlp.down_proj,
    )
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    head_norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
    return FusedLlamaLayer(attn.layer_idx, shape, norms, linears, attention, attn.scaling, head_norms)


def stacked(*linears: nn.Linear) -> nn.Linear:
    """One linear of the first's class whose output is the given linears' outputs concatenated."""
    first = linears[0]
    assert all(type(lin) is type(first) and lin.in_features == first.in_features for lin in linears)
    has_bias = first.bias is not None
    fused = type(first)(
        first.in_features, sum(lin.out_features for lin in linears), bias=has_bias, device="meta"
    )
    fused.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused


# The base model classes `_rebuild_llama` rebuilds: their decoder layer class.
LLAMA_SHAPED = {
    LlamaModel: LlamaDecoderLayer,
    MistralModel: MistralDecoderLayer,
    Qwen2Model: Qwen2DecoderLayer,
    Qwen3Model: Qwen3DecoderLayer,
}
# The fused forwards by transformers model_type.
ARCHITECTURES: dict[str, Architecture] = {
    name: Architecture(_llama_misfit, _rebuild_llama) for name in ("llama", "mistral", "qwen2", "qwen3")
}
# What sets the layers of the other served architectures (compute_service.architectures) apart, for the
# plan's reason.
UNFUSED_LAYERS: dict[str, str] = {
    "gemma2": "Gemma 2 layers (four norms, GELU, soft-capping)",
    "gemma3_text": "Gemma 3 layers (four norms, QK-norm, GELU)",
    "phi3": "Phi-3 layers",
    "mixtral": "mixture-of-experts layers",
    "qwen2_moe": "mixture-of-experts layers",
    "qwen3_moe": "mixture-of-experts layers",
    "olmoe": "mixture-of-experts layers",
}
