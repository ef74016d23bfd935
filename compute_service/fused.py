"""Fewer, larger ops: a loaded Llama-family model rebuilt on compute_service.llama_layer.

q/k/v become one linear (their weights stacked, the output split after), gate/up another; the residual
stream is one tensor updated in place and the RMSNorms work on their temporaries in place; the per-layer
forward calls the paged attention function directly, with none of transformers' kwargs plumbing, mask
creation or output capture.

Which models: transformers' Llama classes (LlamaDecoderLayer, SiLU MLP) in float32. Others keep
transformers' own forward. NOTE: float32 only, because bfloat16 parity with transformers is held token for
token, and transformers computes RMSNorm in float32 and rounds to bfloat16 before the weight product, which
this forward (all in the input's dtype) does not reproduce.
"""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel

from compute_service.llama_layer import FusedLlamaLayer, FusedLlamaModel


def can_fuse(model: PreTrainedModel) -> bool:
    """Whether `fuse` applies: a transformers Llama stack in float32 with SiLU and a paged attention."""
    base = getattr(model, "model", None)
    return (
        type(base) is LlamaModel
        and model.dtype == torch.float32
        and model.config.hidden_act == "silu"
        and all(type(layer) is LlamaDecoderLayer for layer in base.layers)
        and _is_paged(model.config._attn_implementation)
    )


def _is_paged(attn_implementation: str) -> bool:
    """A paged attention function (compute_service.model_loader.register_attention): the fused stack keeps no
    KV cache of its own, so any other attention would see only the step's new tokens."""
    return attn_implementation.startswith("pagedserve_") and attn_implementation in ALL_ATTENTION_FUNCTIONS


def fuse(model: PreTrainedModel) -> bool:
    """Replaces `model.model` in place by a FusedLlamaModel over the same weights if `can_fuse`; returns
    whether it did. The embedding stays shared with a tied output head."""
    if not can_fuse(model):
        return False
    base = model.model
    attention = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    layers = [fused_layer(layer, attention) for layer in base.layers]
    model.model = FusedLlamaModel(base.embed_tokens, layers, base.norm, base.rotary_emb)
    return True


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
    return FusedLlamaLayer(attn.layer_idx, shape, norms, linears, attention, attn.scaling)


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
