"""Mixture-of-experts layers on the plan's linear kernels (compute_service/experts.py) compute what
transformers' experts modules compute, for every MoE family served, on prompt- and decode-sized inputs."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from compute_service import planning
from compute_service.experts import PackedExperts, pack_experts, packable
from tests.architectures import tiny_config

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _experts(model) -> list:
    return [module for module in model.modules() if packable(module)]


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_packed_experts_equal_transformers_experts(name, tokens):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32).eval()
    experts = _experts(model)
    assert experts, f"{name} has experts modules of the packable layout"
    original = experts[0]
    choice = planning.dense_linears(planning.Flags(), "float32", planning.this_machine())
    packed = PackedExperts(original, choice)
    hidden = torch.randn(tokens, original.gate_up_proj.shape[2])
    k = 2
    index = torch.stack([torch.randperm(original.num_experts)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k).softmax(-1)
    with torch.inference_mode():
        torch.testing.assert_close(packed(hidden, index, weights), original(hidden, index, weights))


def test_every_experts_module_of_a_model_is_replaced_and_its_logits_kept():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"), dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 17))
    with torch.inference_mode():
        expected = model(ids).logits
        choice = planning.dense_linears(planning.Flags(), "float32", planning.this_machine())
        layers = model.config.num_hidden_layers
        assert pack_experts(model, choice) == layers
        assert not _experts(model) and sum(isinstance(m, PackedExperts) for m in model.modules()) == layers
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
