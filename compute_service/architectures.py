"""The decoder architectures compute serves: which Hugging Face model types, how each layer attends (all keys
or a sliding window, logit soft-capping), how long a sequence may grow, and a one-line refusal for anything
else, given before any weight is read.

A layer's attention comes from the config as transformers' own masks read it (`layer_types` with
`sliding_window`, else `sliding_window` for every layer), not from what a layer passes to the attention
function: some (Qwen2-MoE) leave their window to the mask and pass none.
"""

from dataclasses import dataclass

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

# The model types served, each verified token for token against transformers (docs/models.md names the
# models of each).
ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
)  # fmt: skip
SLIDING, FULL_ATTENTION = "sliding_attention", "full_attention"
# The types whose attention applies attn_logit_softcapping (Gemma 3's config has the field; its attention
# does not pass it on).
ATTENTION_SOFTCAP = ("gemma2",)
# Rotary embeddings whose frequencies transformers recomputes from the longest position of each forward:
# a packed step would give every sequence the frequencies of the longest, so these are served up to the
# length where the frequencies stay the original ones.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer attends: a query at position p sees keys (p - window, p] (window 0: every key up to p),
    its scores s soft-capped as softcap * tanh(s / softcap) (0: not capped)."""

    window: int = 0
    softcap: float = 0.0


FULL = LayerAttention()


class UnsupportedModel(ValueError):
    """A checkpoint compute does not serve; the message names it and what is served."""


def supported() -> str:
    return ", ".join(ARCHITECTURES)


def check(config: PretrainedConfig) -> None:
    """UnsupportedModel unless compute serves this config: a served model type whose layers are full or
    sliding-window attention, unquantised or a GGUF already converted."""
    model_type = getattr(config, "model_type", "") or "(none)"
    if model_type not in ARCHITECTURES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is {_kind(config)}; pagedserve serves decoder-only text models of "
            f"the types {supported()} (docs/models.md)"
        )
    for layer, kind in enumerate(getattr(config, "layer_types", None) or ()):
        if kind not in (SLIDING, FULL_ATTENTION):
            raise UnsupportedModel(
                f"{model_type}: layer {layer} is {kind!r} attention, which pagedserve does not implement; "
                f"it serves {FULL_ATTENTION} and {SLIDING} layers"
            )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModel(
            f"{model_type}: use_bidirectional_attention (an embedding model) is not served; pagedserve "
            "serves causal decoders"
        )
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise UnsupportedModel(
            f"{model_type}: a {method}-quantised checkpoint is not served; pagedserve loads float16/bfloat16/"
            "float32 checkpoints or a GGUF, and quantises with --weights int8 or int4"
        )


def _kind(config: PretrainedConfig) -> str:
    """What a model type not served is, in a few words."""
    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or any(
        hasattr(config, name) for name in ("vision_config", "audio_config")
    ):
        return "a multimodal model"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "an encoder-only model"
    return "not a model type pagedserve knows"


def layer_attention(config: PretrainedConfig) -> tuple[LayerAttention, ...]:
    """Each layer's attention, as transformers' masks and attention modules apply it."""
    capped = config.model_type in ATTENTION_SOFTCAP
    softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0) if capped else 0.0
    window = int(getattr(config, "sliding_window", None) or 0)
    kinds = getattr(config, "layer_types", None) or [SLIDING if window else FULL_ATTENTION] * (
        config.num_hidden_layers
    )
    return tuple(LayerAttention(window if kind == SLIDING else 0, softcap) for kind in kinds)


def sliding_windows(config: PretrainedConfig) -> tuple[int, ...]:
    """Each layer's window (0: full attention): the layers' groups a KV cache can keep apart."""
    return tuple(layer.window for layer in layer_attention(config))


def final_softcap(config: PretrainedConfig) -> float:
    """The cap of the output logits (Gemma 2: final_logit_softcapping), 0.0 when they are not capped."""
    return float(getattr(config, "final_logit_softcapping", None) or 0.0)


def max_model_len(config: PretrainedConfig) -> int:
    """The longest sequence served: max_position_embeddings, or for a length-dependent rotary embedding
    (LENGTH_DEPENDENT_ROPE) the length its original frequencies cover."""
    length = int(config.max_position_embeddings)
    for rope in _rope_parameters(config):
        if rope.get("rope_type") in LENGTH_DEPENDENT_ROPE:
            original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
            length = min(length, int(original))
    return length


def rope_types(config: PretrainedConfig) -> tuple[str, ...]:
    """The rotary embeddings' types (one per layer type for Gemma 3), for the log."""
    return tuple(sorted({rope.get("rope_type", "default") for rope in _rope_parameters(config)}))


def _rope_parameters(config: PretrainedConfig) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or {}
    if all(isinstance(value, dict) for value in params.values()) and params:
        return list(params.values())
    return [params]
