"""The fused Llama stack (compute_service.fused) computes the logits transformers' layers compute."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from compute_service import planning
from compute_service.batch import ForwardBatch
from compute_service.fused import fuse, misfit
from compute_service.linear import replace_linears
from compute_service.llama_layer import FusedLlamaModel
from compute_service.model_loader import register_attention
from compute_service.runner import Runner, StepTimes
from compute_service.validation import Limits
from tests.architectures import tiny_config
from tests.forward import forward_request
from tests.tiny_model import tiny_llama_config

BLOCK_SIZE, NUM_BLOCKS = 4, 48
# sequence 0 decodes after 9 cached tokens, 1 is a fresh prompt, 2 a prompt chunk over 5 cached tokens,
# 3 decodes after 14
CACHED = [9, 0, 5, 14]
TABLES = [[40, 2, 17], [5, 31, 8], [44, 12, 3, 29], [0, 21, 9, 38]]


def paged_model(seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        tiny_llama_config(initializer_range=0.3, **overrides),
        attn_implementation=register_attention("cpu"),
        dtype=torch.float32,
    ).eval()


def step_logits(model, new: list[list[int]], cached: list[int], prefilled: list[list[int]]) -> torch.Tensor:
    """Fills each sequence's cached tokens in one step, then runs `new` after them: that step's logits."""
    config = model.config
    runner = Runner(model)
    runner.attach(torch.zeros(config.num_hidden_layers, 2, NUM_BLOCKS, BLOCK_SIZE, 2, config.head_dim))
    limits = Limits(config.vocab_size, config.max_position_embeddings, NUM_BLOCKS, BLOCK_SIZE)
    rows = [i for i, n in enumerate(cached) if n]
    fill = forward_request(
        [prefilled[i] for i in rows], [0] * len(rows), [TABLES[i] for i in rows], block_size=BLOCK_SIZE
    )
    runner.logits(ForwardBatch.from_request(fill, limits))
    times = StepTimes()
    logits = runner.logits(
        ForwardBatch.from_request(forward_request(new, cached, TABLES, block_size=BLOCK_SIZE), limits), times
    )
    assert times.attention > 0, "the paged attention function ran, timed as registered"
    return logits


@pytest.mark.parametrize("packed", [True, False], ids=["packed linear", "plain linear"])
def test_fused_logits_equal_unfused_on_a_decode_and_prefill_mix(packed):
    torch.manual_seed(1)
    prefilled = [torch.randint(3, 256, (n,)).tolist() for n in CACHED]
    new = [[17], torch.randint(3, 256, (7,)).tolist(), torch.randint(3, 256, (6,)).tolist(), [250]]
    unfused, fused = paged_model(), paged_model()
    fuse(fused)
    if packed:
        linear = planning.dense_linears(planning.Flags(), "float32", planning.this_machine())
        assert replace_linears(unfused, linear, linear) == 7 * 2 + 1
        assert replace_linears(fused, linear, linear) == 4 * 2 + 1
    expected = step_logits(unfused, new, CACHED, prefilled)
    got = step_logits(fused, new, CACHED, prefilled)
    assert expected.shape == got.shape == (4, 256)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_fused_projections_stack_the_weights_as_linears_of_the_same_class():
    model = paged_model()
    layer = model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.q_proj.weight.clone(), attn.k_proj.weight.clone(), attn.v_proj.weight.clone()
    gate, up = mlp.gate_proj.weight.clone(), mlp.up_proj.weight.clone()
    embedding = model.get_input_embeddings().weight
    fuse(model)
    fused = model.model.layers[1]
    assert type(fused.qkv_proj) is nn.Linear and type(fused.gate_up_proj) is nn.Linear
    assert torch.equal(fused.qkv_proj.weight, torch.cat([q, k, v]))
    assert torch.equal(fused.gate_up_proj.weight, torch.cat([gate, up]))
    assert isinstance(model.model, FusedLlamaModel)
    assert model.model.embed_tokens.weight is embedding is model.lm_head.weight, "tied head stays tied"


def test_other_models_dtypes_and_activations_keep_transformers_layers():
    llama = tiny_llama_config()
    assert misfit(llama, torch.float32) is None
    assert "float32 only" in misfit(llama, torch.bfloat16)
    assert "SiLU-gated" in misfit(tiny_llama_config(hidden_act="gelu"), torch.float32)
    for name in ("mistral", "qwen2", "qwen3"):
        assert misfit(tiny_config(name), torch.float32) is None, f"{name}: Llama-shaped layers"
    for name in ("gemma2", "mixtral"):
        assert misfit(tiny_config(name), torch.float32).endswith(
            ": the fused forward supports llama, mistral, qwen2, qwen3 only"
        ), name


def test_the_fused_stack_needs_a_paged_attention():
    torch.manual_seed(0)
    unpaged = AutoModelForCausalLM.from_config(tiny_llama_config(), attn_implementation="sdpa")
    with pytest.raises(AssertionError, match="keeps no KV cache of its own"):
        fuse(unpaged)
    assert not isinstance(unpaged.model, FusedLlamaModel)
