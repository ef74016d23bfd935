"""Tiny random-weight embedding models saved as sentence-transformers directories (modules.json, the Pooling
module's config, Normalize), for the embeddings tests: a decoder of Qwen3-Embedding's shape (Qwen3 layers
with QK-norm, a tied head, last-token pooling, normalised) and any other causal LM with the pooling given."""

from pathlib import Path

import torch
from transformers import AutoTokenizer, PretrainedConfig, Qwen3Config

from tests.tiny_model import TINY_SHAPE

# Matryoshka widths the Qwen3-shaped model declares in its config.json (vLLM's `matryoshka_dimensions`).
MATRYOSHKA = [16, 32]


def qwen3_embedding_config(vocab_size: int) -> Qwen3Config:
    shape = {**TINY_SHAPE, "vocab_size": vocab_size, "bos_token_id": None, "eos_token_id": None}
    return Qwen3Config(
        **shape, tie_word_embeddings=True, initializer_range=0.3, matryoshka_dimensions=MATRYOSHKA
    )


def save_sentence_transformer(
    path: Path, config: PretrainedConfig, tokenizer_dir: Path, mode: str, normalize: bool, seed: int = 0
) -> Path:
    """A base model of `config` with random weights, the tokenizer of `tokenizer_dir` (its chat template
    dropped: sentence-transformers would render text through it) and a Pooling module of `mode`
    (lasttoken, mean, cls), saved by sentence-transformers itself."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    from transformers import AutoModel

    torch.manual_seed(seed)
    base = path.parent / f"{path.name}-base"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = None
    AutoModel.from_config(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    transformer = models.Transformer(str(base))
    pooling = models.Pooling(transformer.get_embedding_dimension(), pooling_mode=mode)
    modules = [transformer, pooling, *([models.Normalize()] if normalize else [])]
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path
