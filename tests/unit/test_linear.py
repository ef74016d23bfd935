"""The small-batch linear layer: the same product as nn.Linear, on its own path only where it was measured
faster (float32, CPU, at most SMALL_BATCH_ROWS rows)."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from compute_service.linear import SMALL_BATCH_ROWS, SmallBatchLinear, use_small_batch_linears
from compute_service.model_loader import load
from tests.tiny_model import save_tiny_llama, tiny_llama_config


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4, 16, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 300])
def test_equals_nn_linear_and_takes_the_transposed_path_for_small_batches(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96, bias=bias)
    fast = SmallBatchLinear.like(linear)
    x = torch.randn(1, rows, 64)
    out = fast(x)
    torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)
    assert out.shape == (1, rows, 96)
    # W·xᵀ comes back as a transposed view: its last dimension is strided unless there is one row
    transposed = 1 < rows <= SMALL_BATCH_ROWS
    assert (out.stride(-1) != 1) is transposed


def test_other_dtypes_keep_nn_linear():
    linear = nn.Linear(64, 96, dtype=torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    out = SmallBatchLinear.like(linear)(x)
    assert out.is_contiguous() and torch.equal(out, linear(x))


def test_replacing_keeps_parameters_shared_and_tied():
    model = AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True)).eval()
    before = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert use_small_batch_linears(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == before
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert use_small_batch_linears(model) == 0


@pytest.mark.parametrize("plain", [False, True])
def test_the_loader_takes_the_small_batch_path_unless_plain_linear_is_asked(tmp_path, plain):
    model, _ = load(str(save_tiny_llama(tmp_path / "tiny")), torch.float32, plain_linear=plain)
    kinds = {type(module) for module in model.modules() if isinstance(module, nn.Linear)}
    assert kinds == ({nn.Linear} if plain else {SmallBatchLinear})
