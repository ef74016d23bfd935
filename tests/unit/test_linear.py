"""The packed linear layer: the same product as nn.Linear through oneDNN on a weight reordered once, on
float32 CPU layers only, in float32 or bfloat16 (mixed precision); the loader packs them last."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from compute_service.batch import ForwardBatch
from compute_service.linear import PACK_ROWS, PackedLinear, pack_linears
from compute_service.model_loader import load
from compute_service.quantized import QuantizedLinear
from compute_service.runner import Runner
from compute_service.validation import Limits
from tests.forward import forward_request
from tests.tiny_model import needs_native_bfloat16, save_tiny_llama, tiny_llama_config


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 7, PACK_ROWS, PACK_ROWS + 1, 300])
def test_equals_f_linear_at_any_batch_size(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(1, rows, 64)
    out = PackedLinear(linear)(x)
    assert out.shape == (1, rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, PACK_ROWS + 1, 300])
def test_bfloat16_packing_multiplies_bfloat16_rounded_inputs_and_weights(rows, bias):
    """Mixed precision: float32 in and out, the product of the bfloat16-rounded input and weight accumulated
    in float32 (so equal to float32 arithmetic on the rounded values), float32 bias added."""
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(1, rows, 64)
    packed = PackedLinear(linear, torch.bfloat16)
    out = packed(x)
    assert out.dtype == torch.float32 and out.shape == (1, rows, 96)
    rounded = F.linear(x.bfloat16().float(), linear.weight.bfloat16().float(), linear.bias)
    # NOTE: the float32 product is rounded to bfloat16 once on the way out (oneDNN's output is bfloat16).
    torch.testing.assert_close(out, rounded, atol=2e-2, rtol=1e-2)
    exact = F.linear(x, linear.weight, linear.bias)
    assert (out - exact).abs().max() > 0, "the weights are held in bfloat16, not float32"
    assert "bfloat16" in repr(packed)


def test_bfloat16_packing_is_refused_where_the_cpu_would_emulate_it(tmp_path, monkeypatch):
    monkeypatch.setattr("compute_service.model_loader.bfloat16_native", lambda: False)
    with pytest.raises(ValueError, match="need a cpu with AVX512-BF16 or AMX"):
        load(str(save_tiny_llama(tmp_path / "tiny")), torch.float32, weights="bfloat16")


@needs_native_bfloat16
def test_the_loader_packs_bfloat16_weights_in_a_float32_model(tmp_path):
    path = str(save_tiny_llama(tmp_path / "tiny", initializer_range=0.3))
    model, spec = load(path, torch.float32, weights="bfloat16")
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and {m.dtype for m in packed} == {torch.bfloat16}
    assert spec.weights == "bfloat16" and spec.dtype == torch.float32 and spec.kv_dtype == torch.float32
    reference, _ = load(path, torch.float32)
    request = forward_request([torch.randint(3, 256, (12,)).tolist()], [0], [[0, 1, 2]], block_size=4)
    config = model.config
    pool = torch.zeros(config.num_hidden_layers, 2, 3, 4, config.num_key_value_heads, config.head_dim)
    logits = []
    for m in (model, reference):
        runner = Runner(m)
        runner.attach(pool.clone())
        limits = Limits(config.vocab_size, config.max_position_embeddings, 3, 4)
        logits.append(runner.logits(ForwardBatch.from_request(request, limits)))
    error = (logits[0] - logits[1]).abs().max() / logits[1].abs().max()
    assert 0 < error < 0.1, "bfloat16 rounding (~2^-8 per product, grown over the random layers), not more"


def test_plain_linear_refuses_bfloat16_weights(tmp_path):
    with pytest.raises(ValueError, match="--plain-linear keeps dense nn.Linear"):
        load(str(save_tiny_llama(tmp_path / "tiny")), torch.float32, weights="bfloat16", plain_linear=True)


def test_takes_a_strided_input():
    linear = nn.Linear(64, 96, bias=False)
    x = torch.randn(64, 5).t()
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


def test_packs_float32_cpu_linears_only_and_keeps_the_tied_embedding():
    model = AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True)).eval()
    embedding = model.get_input_embeddings().weight
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == linears > 0
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.get_input_embeddings().weight is embedding, "the embedding keeps the plain weight"
    assert pack_linears(model) == 0
    assert pack_linears(nn.Sequential(nn.Linear(8, 8, dtype=torch.bfloat16))) == 0


def test_packed_model_gives_the_same_logits():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(initializer_range=0.3)).eval()
    ids = torch.randint(3, 256, (1, 12))
    with torch.inference_mode():
        expected = model(ids).logits
        pack_linears(model)
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("plain", [False, True])
def test_the_loader_packs_unless_plain_linear_is_asked(tmp_path, plain):
    model, _ = load(str(save_tiny_llama(tmp_path / "tiny")), torch.float32, plain_linear=plain)
    kinds = {type(module) for module in model.modules() if isinstance(module, (nn.Linear, PackedLinear))}
    assert kinds == ({nn.Linear} if plain else {PackedLinear})


def test_the_loader_packs_the_dense_path_of_quantised_linears(tmp_path):
    model, _ = load(str(save_tiny_llama(tmp_path / "tiny")), torch.float32, weights="int8")
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(type(m.dense) is PackedLinear for m in quantized)
    assert not any(type(m) is nn.Linear for m in model.modules())
