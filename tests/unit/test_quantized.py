"""Weight-only quantised linears (compute_service/quantized.py): the product against F.linear per mode, on
int8 panels and on torch's kernels (the kernel chosen by rows), generic replacement, and the refusals."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from compute_service import kernels
from compute_service.model_loader import load
from compute_service.quantized import (
    QUANTIZED_MAX_ROWS,
    QuantizedLinear,
    quantize_linears,
    resolve_weights,
)
from tests.tiny_model import save_tiny_llama, tiny_llama_config

# Relative error of the product against the original weights (measured: int8 ~8e-3, int4 ~8e-2 on random
# weights; bfloat16 activations add ~4e-3).
TOLERANCE = {"int8": 0.02, "int4": 0.12}


needs_native = pytest.mark.skipif(kernels.load() is None, reason="the native kernels cannot be built here")


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


@pytest.fixture
def torch_kernels(monkeypatch):
    """QuantizedLinear as on a machine where the native kernels do not build: torch's kernels for int8 too."""
    monkeypatch.setattr("compute_service.quantized.kernels", SimpleNamespace(load=lambda: None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 4, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 64, 200])
def test_close_to_f_linear_on_both_torch_paths(mode, rows, dtype, torch_kernels):
    torch.manual_seed(rows)
    linear = nn.Linear(128, 96, bias=True, dtype=dtype)
    quantized = QuantizedLinear(linear, mode)
    x = torch.randn(1, rows, 128, dtype=dtype)
    out = quantized(x)
    assert out.shape == (1, rows, 96) and out.dtype == dtype
    assert relative_error(out, F.linear(x, linear.weight, linear.bias)) < TOLERANCE[mode]
    # Both paths multiply by the same quantised values: the dense weight is their dequantised form.
    dense = F.linear(x.float(), quantized.dense.weight.float(), linear.bias.float())
    assert relative_error(out, dense) < 1e-2


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_kernel_up_to_the_row_limit_dense_gemm_above(mode, monkeypatch, torch_kernels):
    quantized = QuantizedLinear(nn.Linear(64, 32, bias=False), mode)
    kernel = "_weight_int8pack_mm" if mode == "int8" else "_weight_int4pack_mm_for_cpu"
    calls = []
    original = getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda *a: calls.append(a[0].shape[0]) or original(*a))
    for rows in (1, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 300):
        quantized(torch.randn(rows, 64))
    assert calls == [1, QUANTIZED_MAX_ROWS]
    assert quantized.uses_kernel(QUANTIZED_MAX_ROWS) and not quantized.uses_kernel(QUANTIZED_MAX_ROWS + 1)


def test_int8_holds_one_byte_per_weight_and_int4_half(torch_kernels):
    linear = nn.Linear(128, 64, bias=False)
    int8, int4 = QuantizedLinear(linear, "int8"), QuantizedLinear(linear, "int4")
    assert int8.qweight.dtype == torch.int8 and int8.qweight.numel() == 64 * 128
    assert int4.qweight.numel() * int4.qweight.element_size() == 64 * 128 // 2


@needs_native
@pytest.mark.parametrize("rows", [1, 4, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 64, 200])
def test_int8_panels_multiply_the_torch_paths_values_at_every_batch_size(rows, monkeypatch):
    """A float32 model's int8 layer on panels: float32 activations (no bfloat16 rounding), the same quantised
    values as torch's paths (their dense weight is the dequantised one), and no dense copy."""
    torch.manual_seed(rows)
    linear = nn.Linear(128, 96, bias=True)
    panels = QuantizedLinear(linear, "int8")
    with monkeypatch.context() as patch:
        patch.setattr("compute_service.quantized.kernels", SimpleNamespace(load=lambda: None))
        reference = QuantizedLinear(linear, "int8")
    assert panels.panels and not reference.panels and "native panels" in repr(panels)
    x = torch.randn(2, rows, 128)
    expected = F.linear(x, reference.dense.weight, linear.bias)
    torch.testing.assert_close(panels(x), expected, atol=1e-5, rtol=1e-5)
    assert panels.uses_kernel(rows)
    held = {name: t.dtype for name, t in [*panels.named_parameters(), *panels.named_buffers()]}
    assert held == {"bias": torch.float32, "qweight": torch.int8, "scales": torch.float32}


@needs_native
def test_int4_and_bfloat16_models_keep_torchs_kernels():
    assert not QuantizedLinear(nn.Linear(128, 64), "int4").panels
    assert not QuantizedLinear(nn.Linear(128, 64, dtype=torch.bfloat16), "int8").panels


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_replaces_every_linear_fused_ones_too(mode):
    model = AutoModelForCausalLM.from_config(tiny_llama_config()).eval()
    layer = model.model.layers[0].self_attn
    # A fused projection stands in for what a fused-QKV model holds: any nn.Linear subclass is replaced.
    layer.qkv_proj = nn.Linear(64, 128, bias=False)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert quantize_linears(model, mode) == linears
    # the only nn.Linear left: the dense paths of the layers on torch's kernels (for batches above their rows)
    dense = {id(m.dense) for m in model.modules() if isinstance(m, QuantizedLinear) and not m.panels}
    assert {id(m) for m in model.modules() if isinstance(m, nn.Linear)} == dense
    assert isinstance(layer.qkv_proj, QuantizedLinear) and layer.qkv_proj.mode == mode
    # the output head is int8 in either mode (int4 there cost 3.7 % perplexity)
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.mode == "int8"
    assert quantize_linears(model, mode) == 0


def test_the_output_head_can_stay_dense_and_tied():
    model = AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True)).eval()
    quantize_linears(model, "int8", lm_head=False)
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_dense_modes_replace_nothing():
    model = AutoModelForCausalLM.from_config(tiny_llama_config()).eval()
    assert quantize_linears(model, "float32") == 0
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


@pytest.mark.parametrize(
    ("weights", "dtype", "expected"),
    [("auto", "float32", "float32"), ("auto", "bfloat16", "bfloat16"), ("bfloat16", "bfloat16", "bfloat16"),
     ("bfloat16", "float32", "bfloat16"), ("int8", "float32", "int8"), ("int4", "bfloat16", "int4")],
)  # fmt: skip
def test_resolves_weights_against_the_dtype(weights, dtype, expected):
    assert resolve_weights(weights, dtype) == expected


@pytest.mark.parametrize(
    ("weights", "dtype", "message"),
    [("int3", "float32", "unknown --weights 'int3'"), ("float32", "bfloat16", "pass --dtype float32")],
)  # fmt: skip
def test_refuses_unknown_modes_and_another_dense_dtype(weights, dtype, message):
    with pytest.raises(ValueError, match=message):
        resolve_weights(weights, dtype)


def test_int4_refuses_shapes_the_kernel_cannot_hold_and_changes_nothing():
    model = AutoModelForCausalLM.from_config(tiny_llama_config()).eval()
    model.model.layers[1].mlp.odd = nn.Linear(64, 40, bias=False)
    with pytest.raises(ValueError, match="out_features by 16.*'LlamaMLP.odd' is 40 x 64: use --weights int8"):
        quantize_linears(model, "int4")
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    assert quantize_linears(model, "int8") > 0


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_loader_quantises_and_names_the_mode(tmp_path, mode):
    model, spec = load(str(save_tiny_llama(tmp_path / "tiny")), torch.float32, weights=mode)
    assert spec.weights == mode and spec.dtype_name == "float32"
    assert all(not isinstance(m, nn.Linear) for m in model.modules())


def test_the_loader_names_the_dense_dtype_and_refuses_plain_linear_with_quantised(tmp_path):
    path = str(save_tiny_llama(tmp_path / "tiny"))
    assert load(path, torch.bfloat16)[1].weights == "bfloat16"
    with pytest.raises(ValueError, match="--plain-linear .* cannot combine with --weights int4"):
        load(path, torch.float32, plain_linear=True, weights="int4")


@pytest.mark.parametrize("device", ["cuda", "npu:0"])
def test_the_loader_refuses_quantised_weights_off_the_cpu_before_loading(device):
    message = f"--weights int8 runs torch's CPU kernels; on {device} use --weights auto"
    with pytest.raises(ValueError, match=message):
        load("no-such-model", torch.float32, device=device, weights="int8")
