"""Tiny random-weight configs of every architecture compute serves (compute_service.architectures), each
with the features that set it apart: rope scalings, QKV biases, QK-norm, sliding windows (shorter than the
test prompts, not multiples of a block), soft-capping, experts. Saved as ordinary Hugging Face directories.

NOTE: Gemma 2's caps are lower than the real model's (50 and 30) so that they change this model's tokens and
log-probabilities; Gemma 3 has them too, of which transformers applies the final one, not the attention's.
Gemma's output head is untied here: with the input embedding scaled by sqrt(hidden) and tied to the head, a
random Gemma repeats its input token, which would not test attention."""

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests.tiny_model import TINY_SHAPE

# NOTE: peaked logits (a wide initialisation), so that greedy picks are clear.
BASE = dict(TINY_SHAPE, initializer_range=0.3, pad_token_id=0)
EXPERTS = dict(num_experts_per_tok=2, output_router_logits=False)


def _llama(rope: dict) -> LlamaConfig:
    return LlamaConfig(**BASE, rope_parameters={"rope_theta": 10000.0, **rope})


# name -> config; the expected per-layer windows are in SLIDING_WINDOWS.
CONFIGS = {
    "llama3-rope": lambda: _llama(
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),  # fmt: skip
    "llama-linear-rope": lambda: _llama({"rope_type": "linear", "factor": 2.0}),
    "llama-dynamic-rope": lambda: _llama({"rope_type": "dynamic", "factor": 2.0}),
    "llama-yarn-rope": lambda: _llama(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    ),
    "qwen2": lambda: Qwen2Config(
        **BASE, tie_word_embeddings=True, use_sliding_window=True, sliding_window=11, max_window_layers=1
    ),
    "qwen3": lambda: Qwen3Config(**BASE, use_sliding_window=True, sliding_window=11, max_window_layers=1),
    "mistral": lambda: MistralConfig(**BASE, sliding_window=13),
    "gemma2": lambda: Gemma2Config(
        **BASE,
        sliding_window=10,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "gemma3_text": lambda: Gemma3TextConfig(
        **{**BASE, "num_hidden_layers": 6},
        sliding_window=9,
        query_pre_attn_scalar=24,
        tie_word_embeddings=False,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),  # fmt: skip
    "phi3": lambda: Phi3Config(
        **BASE,
        sliding_window=12,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),  # fmt: skip
    "mixtral": lambda: MixtralConfig(**BASE, **EXPERTS, num_local_experts=4, sliding_window=14),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **BASE,
        **EXPERTS,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        use_sliding_window=True,
        sliding_window=10,
        max_window_layers=1,
    ),  # fmt: skip
    "qwen3_moe": lambda: Qwen3MoeConfig(**BASE, **EXPERTS, num_experts=4, moe_intermediate_size=32),
    "olmoe": lambda: OlmoeConfig(**BASE, **EXPERTS, num_experts=4),
}
# Each config's layer windows as transformers' masks apply them (0: full attention).
SLIDING_WINDOWS = {
    "llama3-rope": (0, 0),
    "llama-linear-rope": (0, 0),
    "llama-dynamic-rope": (0, 0),
    "llama-yarn-rope": (0, 0),
    "qwen2": (0, 11),
    "qwen3": (0, 11),
    "mistral": (13, 13),
    "gemma2": (10, 0),
    "gemma3_text": (9, 9, 9, 9, 9, 0),
    "phi3": (12, 12),
    "mixtral": (14, 14),
    "qwen2_moe": (10, 0),
    "qwen3_moe": (0, 0),
    "olmoe": (0, 0),
}

# The execution plan's layer forwards (stages `layers`, `layers.decode`) of the Llama-shaped stacks loaded in
# float32 on cpu-native: fused layers, the native decode stack for all-decode steps (Qwen2's QKV biases,
# Qwen3's head norms and both models' two KV groups, full and sliding, in it too). The others run
# transformers' layers (UNFUSED).
FAST_PATH = {
    "llama": ("fused", "native-stack"),
    "mistral": ("fused", "native-stack"),
    "qwen2": ("fused", "native-stack"),
    "qwen3": ("fused", "native-stack"),
}
UNFUSED = ("transformers", "transformers")


def tiny_config(name: str) -> PretrainedConfig:
    return CONFIGS[name]()


def save_tiny(name: str, path: Path, seed: int = 0) -> Path:
    """The random-weight model of config `name`, saved as a Hugging Face directory at `path`; a Qwen2 or
    Qwen3 with its biases and head norms drawn too (`draw_biases_and_head_norms`)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name))
    if name in DRAWN:
        draw_biases_and_head_norms(model)
    model.save_pretrained(path)
    return path


# The configs whose biases and head norms save_tiny draws at random.
DRAWN = ("qwen2", "qwen3")


@torch.no_grad()
def draw_biases_and_head_norms(model: torch.nn.Module) -> None:
    """Every linear's bias and every per-head RMSNorm's weight (q_norm, k_norm) drawn at random: transformers
    initialises them to 0 and 1, which a forward dropping them would match."""
    for name, parameter in model.named_parameters():
        if name.endswith(".bias"):
            parameter.normal_(0.0, 0.3)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            parameter.uniform_(0.5, 1.5)
