"""`bench --model-shape`: the published shapes' configs, and the random-weight directories built from them
(loaded by transformers as they are saved, a token for every id, sharded when large, built once)."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cli.bench import shapes


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _parameters(name: str) -> int:
    config = AutoConfig.for_model(**shapes.config_values(name))
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_the_published_shapes_have_their_models_parameter_counts():
    assert _parameters("qwen2.5-0.5b") == 494_032_768, "Qwen2.5-0.5B: 0.49B parameters, tied embeddings"
    assert _parameters("llama3.2-1b") == 1_235_814_400, "Llama-3.2-1B: 1.24B parameters, tied embeddings"
    qwen = AutoConfig.for_model(**shapes.config_values("qwen2.5-0.5b"))
    assert (
        type(qwen).__name__ == "Qwen2Config" and qwen.num_key_value_heads == 2 and qwen.vocab_size == 151936
    )
    llama = AutoConfig.for_model(**shapes.config_values("llama3.2-1b"))
    assert llama.head_dim == 64 and llama.num_key_value_heads == 8 and llama.vocab_size == 128256
    with pytest.raises(KeyError, match="no model shape 'gpt-9': choose one of smollm2-135m, qwen2.5-0.5b"):
        shapes.config_values("gpt-9")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_a_shape_is_saved_as_a_model_transformers_loads_whole(cache, name):
    path = shapes.model_dir(name)
    assert path.parent == cache / "models" and path.name.startswith(f"{name}-random-")
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], "every weight saved, under its name"
    assert model.config.vocab_size == shapes.SHAPES[name]["vocab_size"]
    weights = dict(model.named_parameters())
    assert torch.all(weights["model.norm.weight"] == 1), "norms start at 1"
    embedding = weights["model.embed_tokens.weight"]
    assert 0.015 < embedding.std().item() < 0.025, "normal with the published init's std"
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert all(tokenizer.decode([i]) == f"t{i}" for i in (3, 517, 1023)), "a token for every id"
    assert shapes.model_dir(name) == path, "built once"


def test_large_shapes_are_saved_in_shards_with_an_index(cache, monkeypatch):
    monkeypatch.setattr(shapes, "SHARD_BYTES", 2**16)
    out = cache / "sharded"
    shapes.build(shapes.SHAPES["tiny-llama"], out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert (
        len(files) > 2 and all((out / f).exists() for f in files) and not (out / "model.safetensors").exists()
    )
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and model.config.num_hidden_layers == 2
