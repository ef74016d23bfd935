"""Hugging Face directories as users have them: sharded safetensors load and generate as one file does; the
EOS ids come from generation_config.json when there is one (all of them) and from config.json otherwise."""

import json

import torch

from compute_service.model_loader import load
from tests.architectures import save_tiny
from tests.paged_greedy import ALONE, Served, alone_greedy, assert_equal_greedy, reference


def test_a_sharded_checkpoint_loads_and_generates_as_the_model_does(tmp_path):
    path = save_tiny("qwen3", tmp_path / "one")
    sharded = tmp_path / "sharded"
    reference(path).save_pretrained(sharded, max_shard_size="100KB")
    assert (
        len(list(sharded.glob("*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").exists()
    )
    assert_equal_greedy(path, ALONE, alone_greedy(Served(sharded, "cpu-native")), "a sharded checkpoint")


def test_eos_ids_come_from_generation_config_else_from_the_config(tmp_path):
    path = save_tiny("mistral", tmp_path / "mistral")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9], "bos_token_id": 1}))
    assert load(str(path), torch.float32, "cpu")[1].eos_token_ids == (2, 7, 9)
    (path / "generation_config.json").unlink()
    assert load(str(path), torch.float32, "cpu")[1].eos_token_ids == (2,)
