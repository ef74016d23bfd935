"""`bench --model-shape NAME`: a random-weight model of a real model's shape, for every engine alike.

Speed does not depend on the weights' values, so a published model's config (its architecture, sizes and
vocabulary) with random weights benches as the model itself would. The model is saved once as a Hugging Face
directory in the cache (bfloat16 weights, as those models are published; each engine loads them in its own
dtype), with a word-level tokenizer of the model's vocabulary size, so that every token id has a token. vLLM
loads the same config with `load_format="dummy"` (its own random weights).
"""

import hashlib
import json
from pathlib import Path

import torch

from common.model_files import DEFAULT_MODEL, built_once, cache_root, local_copy

# The published configs' values (Qwen/Qwen2.5-0.5B-Instruct, meta-llama/Llama-3.2-1B-Instruct); the tiny
# shapes are for quick checks of a setup.
QWEN2_5_0_5B = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "max_window_layers": 21, "sliding_window": 32768,
    "use_sliding_window": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip
LLAMA3_2_1B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}  # fmt: skip
# NOTE: heads of 64, as vLLM's CPU attention takes (it refuses 16).
TINY = {
    "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048, "hidden_act": "silu",
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
DEFAULT_SHAPE = "smollm2-135m"
SHAPES = {
    # The shipped SmolLM2-135M's own config (read from it), the shape the bench runs without --model-shape.
    DEFAULT_SHAPE: None,
    "qwen2.5-0.5b": QWEN2_5_0_5B,
    "llama3.2-1b": LLAMA3_2_1B,
    "tiny-llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **TINY},
    "tiny-qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **TINY},
}
INIT_STD = 0.02  # transformers' initializer_range: the published models' random init
SHARD_BYTES = 2**30
# Bumped when what build writes changes, so that older cached copies are not reused.
FORMAT = 1


def config_values(name: str) -> dict:
    """The shape's config values; KeyError naming the shapes there are."""
    if name not in SHAPES:
        raise KeyError(f"no model shape {name!r}: choose one of {', '.join(SHAPES)}")
    values = SHAPES[name]
    if values is None:
        values = json.loads((local_copy(DEFAULT_MODEL).path / "config.json").read_text())
    return {k: v for k, v in values.items() if k not in ("dtype", "torch_dtype", "transformers_version")}


def model_dir(name: str, seed: int = 0) -> Path:
    """The shape's random-weight model directory in the cache, built the first time."""
    values = config_values(name)
    key = hashlib.sha256(json.dumps([values, seed, FORMAT], sort_keys=True).encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"{name}-random-{key}"
    return built_once(target, lambda out: build(values, out, seed))


def build(values: dict, out: Path, seed: int = 0) -> None:
    """A Hugging Face model directory at out: config, random bfloat16 weights (norms 1, biases 0, the rest
    normal with INIT_STD), in shards of at most SHARD_BYTES, and a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**values, dtype="bfloat16")
    with torch.device("meta"):
        # NOTE: on the meta device nothing is allocated; the parameters give names and shapes (tied weights
        # once), as save_pretrained would write them.
        shapes = [(n, p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    out.mkdir(parents=True)
    config.save_pretrained(out)
    _save_weights(shapes, out, torch.Generator().manual_seed(seed))
    tokenizer(config).save_pretrained(out)


def _init(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    tensor = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, 2**24 // shape[-1])
    for start in range(0, shape[0], rows):
        part = tensor[start : start + rows]
        part.copy_(torch.randn(part.shape, generator=generator) * INIT_STD)
    return tensor


def _save_weights(shapes: list[tuple[str, torch.Size]], out: Path, generator: torch.Generator) -> None:
    """The tensors in shards (one model.safetensors if one does), each written once it is full."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}

    def flush() -> None:
        save_file(pending, out / f"shard-{len(shards)}.safetensors", metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()

    for name, shape in shapes:
        pending[name] = _init(name, shape, generator)
        if sum(t.numel() * t.element_size() for t in pending.values()) >= SHARD_BYTES:
            flush()
    if pending:
        flush()
    if len(shards) == 1:
        (out / "shard-0.safetensors").rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{i}.safetensors").rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def tokenizer(config):
    """A word-level tokenizer with one token per id of the config's vocabulary (`t0`, `t1`, ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    return PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token=f"t{config.bos_token_id}", eos_token=f"t{eos}"
    )
