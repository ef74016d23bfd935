"""--tensor-parallel-size's start-up checks (compute_service.tensor_parallel): what the ranks cannot split is
refused in one line naming what is served, before any weight loads; the flags a rank loads with."""

import pytest
import torch

from common.sparse_settings import parse
from compute_service import planning, tensor_parallel
from compute_service.planning import Flags
from tests.architectures import tiny_config
from tests.tiny_model import tiny_llama_config

SERVED = "--tensor-parallel-size serves llama, mistral, qwen2, qwen3, gemma2, gemma3_text models"


@pytest.mark.parametrize("name", ["gemma2", "qwen3", "mistral"])
def test_split_architectures_pass_and_plan(name):
    config = tiny_config(name)
    tensor_parallel.check(config, 2)
    flags = tensor_parallel.flags(Flags())
    tensor_parallel.check_flags(flags, 2)
    assert planning.resolve(config, flags, planning.this_machine()).layers.implementation == "transformers"


def test_a_rank_loads_transformers_layers_on_plain_linears():
    flags = tensor_parallel.flags(Flags())
    assert (flags.fused, flags.plain_linear) == (False, True)


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        (tiny_config("mixtral"), "a mixtral model is not sharded"),
        (tiny_config("phi3"), "a phi3 model is not sharded"),
        (tiny_llama_config(num_key_value_heads=1), "the model's KV heads (1) do not split over 2 ranks"),
        (tiny_llama_config(intermediate_size=129), "the model's MLP columns (129) do not split"),
    ],
)
def test_a_model_the_ranks_cannot_split_is_refused_in_one_line(config, refusal):
    with pytest.raises(ValueError) as refused:
        tensor_parallel.check(config, 2)
    message = str(refused.value)
    assert refusal in message and SERVED in message and "\n" not in message


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (Flags(device="cuda:0"), "on cuda:0: the ranks run on the cpu (gloo)"),
        (Flags(weights="int8"), "--weights int8: "),
        (Flags(kv_dtype=torch.bfloat16), "--kv-dtype bfloat16: "),
        (Flags(sparse_attention=parse("on")), "--sparse-attention: "),
    ],
)
def test_flags_the_ranks_cannot_split_under_are_refused_in_one_line(flags, refusal):
    with pytest.raises(ValueError) as refused:
        tensor_parallel.check_flags(flags, 2)
    message = str(refused.value)
    assert refusal in message and SERVED in message and "\n" not in message


def test_one_rank_serves_anything_served():
    tensor_parallel.check(tiny_config("mixtral"), 1)
    tensor_parallel.check_flags(Flags(weights="int8"), 1)
