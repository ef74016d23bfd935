"""A small random-weight Llama saved as a Hugging Face directory, for fast tests."""

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.cpu import bfloat16_native

# For tests of --weights bfloat16 in a float32 model (refused where oneDNN would emulate bfloat16).
needs_native_bfloat16 = pytest.mark.skipif(
    not bfloat16_native(), reason="this cpu has no native bfloat16 products (AVX512-BF16/AMX)"
)


# The tiny models' shape (tests/architectures.py builds every architecture at it too).
TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=1,
)
# SmolLM2-135M's shape, for speed measurements on random weights (scripts/gpu_bench.py,
# tools/architecture_shapes.py).
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
)


def tiny_llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**TINY_SHAPE, "tie_word_embeddings": True, **overrides})


def save_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    model.save_pretrained(path, safe_serialization=True)
    return path
