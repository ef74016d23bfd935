"""The packed linear layer: the same product as nn.Linear through oneDNN on a weight reordered once, on
float32 CPU layers only; the loader packs them last."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from compute_service.linear import PACK_ROWS, PackedLinear, pack_linears
from compute_service.model_loader import load
from compute_service.quantized import QuantizedLinear
from tests.tiny_model import save_tiny_llama, tiny_llama_config


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 7, PACK_ROWS, PACK_ROWS + 1, 300])
def test_equals_f_linear_at_any_batch_size(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(1, rows, 64)
    out = PackedLinear(linear)(x)
    assert out.shape == (1, rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


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
