"""Weight-only quantised linears (compute_service/quantized.py, the WeightOnly and int8/int4 Panels kernels):
the product against F.linear per mode, on panels and on torch's kernels (the kernel chosen by rows),
replacement in a model as the plan says, and the refusals."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from common.shared_pool import dtype_name
from compute_service import kernels, planning
from compute_service.linear import Linear, kernel_for, replace_linears
from compute_service.linear_kernels import Panels, WeightOnly
from compute_service.model_loader import load
from compute_service.plan import PANELS, TRANSFORMERS, WEIGHT_ONLY, LinearChoice
from compute_service.planning import Flags
from compute_service.quantized import QUANTIZED_MAX_ROWS, quantize, resolve_weights
from tests.tiny_model import save_tiny_llama, tiny_llama_config

# Relative error of the product against the original weights (measured: int8 ~8e-3, int4 ~8e-2 on random
# weights; bfloat16 activations add ~4e-3).
TOLERANCE = {"int8": 0.02, "int4": 0.12}
MACHINE = planning.this_machine()
# torch's kernels for int8 too, as on a machine where the native kernels do not build
WITHOUT_KERNELS = replace(MACHINE, kernels=False)
needs_native = pytest.mark.skipif(kernels.load() is None, reason="the native kernels cannot be built here")


def choice_of(mode: str, dtype: torch.dtype = torch.float32, machine=WITHOUT_KERNELS) -> LinearChoice:
    flags = Flags(dtype)
    return planning.quantized_linears(
        mode, flags, machine, planning.dense_linears(flags, dtype_name(dtype), machine)
    )


def quantized_linear(linear: nn.Linear, mode: str, machine=WITHOUT_KERNELS) -> Linear:
    return Linear(kernel_for(linear.weight, choice_of(mode, linear.weight.dtype, machine)), linear.bias)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 4, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 64, 200])
def test_close_to_f_linear_on_both_torch_paths(mode, rows, dtype):
    torch.manual_seed(rows)
    linear = nn.Linear(128, 96, bias=True, dtype=dtype)
    quantized = quantized_linear(linear, mode)
    assert isinstance(quantized.kernel, WeightOnly)
    x = torch.randn(1, rows, 128, dtype=dtype)
    out = quantized(x)
    assert out.shape == (1, rows, 96) and out.dtype == dtype
    assert relative_error(out, F.linear(x, linear.weight, linear.bias)) < TOLERANCE[mode]
    # Both paths multiply by the same quantised values: the dense kernel holds their dequantised form.
    dense = F.linear(x.float(), quantize(linear.weight, mode).dequantized, linear.bias.float())
    assert relative_error(out, dense) < 1e-2


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_kernel_up_to_the_row_limit_dense_gemm_above(mode, monkeypatch):
    quantized = quantized_linear(nn.Linear(64, 32, bias=False), mode)
    kernel = "_weight_int8pack_mm" if mode == "int8" else "_weight_int4pack_mm_for_cpu"
    calls = []
    original = getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda *a: calls.append(a[0].shape[0]) or original(*a))
    for rows in (1, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 300):
        quantized(torch.randn(rows, 64))
    assert calls == [1, QUANTIZED_MAX_ROWS]
    weight_only = quantized.kernel
    assert weight_only.uses_kernel(QUANTIZED_MAX_ROWS) and not weight_only.uses_kernel(QUANTIZED_MAX_ROWS + 1)


def test_int8_holds_one_byte_per_weight_and_int4_half():
    linear = nn.Linear(128, 64, bias=False)
    int8, int4 = quantized_linear(linear, "int8").kernel, quantized_linear(linear, "int4").kernel
    assert int8.qweight.dtype == torch.int8 and int8.qweight.numel() == 64 * 128
    assert int4.qweight.numel() * int4.qweight.element_size() == 64 * 128 // 2


@needs_native
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 4, 8, 9, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1, 64, 200])
def test_panels_multiply_the_torch_paths_values_at_every_batch_size(rows, mode):
    """A float32 model's int8 or int4 layer on panels: float32 activations (no bfloat16 rounding), the same
    quantised values as torch's paths (their dense weight is the dequantised one), and no dense copy."""
    torch.manual_seed(rows)
    linear = nn.Linear(128, 96, bias=True)
    panels = quantized_linear(linear, mode, MACHINE)
    assert isinstance(panels.kernel, Panels) and f"{mode} panels" in repr(panels)
    x = torch.randn(2, rows, 128)
    expected = F.linear(x, quantize(linear.weight, mode).dequantized, linear.bias)
    torch.testing.assert_close(panels(x), expected, atol=1e-5, rtol=1e-5)
    held = {name: t.dtype for name, t in [*panels.named_parameters(), *panels.named_buffers()]}
    packed, scales = (torch.int8, torch.float32) if mode == "int8" else (torch.uint8, torch.bfloat16)
    assert held == {"bias": torch.float32, "kernel.packed": packed, "kernel.scales": scales}
    assert panels.kernel.packed.numel() * (2 if mode == "int4" else 1) <= 96 * 128 + 128 * 31


def test_float32_models_multiply_int8_and_int4_on_panels_bfloat16_ones_on_torchs_kernels():
    built = replace(MACHINE, kernels=True)
    assert choice_of("int8", machine=built).kernel == PANELS
    assert choice_of("int4", machine=built).kernel == PANELS
    assert choice_of("int8", torch.bfloat16, built).kernel == WEIGHT_ONLY
    assert choice_of("int4", torch.bfloat16, built).kernel == WEIGHT_ONLY


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_replaces_every_linear_fused_ones_too_the_head_in_int8(mode):
    model = AutoModelForCausalLM.from_config(tiny_llama_config()).eval()
    layer = model.model.layers[0].self_attn
    # A fused projection stands in for what a fused-QKV model holds: any nn.Linear is replaced.
    layer.qkv_proj = nn.Linear(64, 128, bias=False)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    decoder, head = planning.linears(Flags(weights=mode), mode, MACHINE)
    assert replace_linears(model, decoder, head) == linears
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(layer.qkv_proj, Linear) and "int8" in head.implementation
    # the output head is int8 in either mode (int4 there costs far more perplexity)
    assert model.lm_head.kernel.packed.dtype == torch.int8 or model.lm_head.kernel.mode == "int8"
    assert replace_linears(model, decoder, head) == 0


def test_the_output_head_can_stay_dense_and_tied():
    model = AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True)).eval()
    replace_linears(model, choice_of("int8"), LinearChoice(TRANSFORMERS, "float32", "dense head"))
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.get_input_embeddings().weight


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


@pytest.mark.parametrize(
    ("machine", "shape", "message"),
    [(WITHOUT_KERNELS, (64, 40), "in_features divisible by 32 and out_features by 16; .* is 40 x 64"),
     (WITHOUT_KERNELS, (40, 64), "in_features divisible by 32 and out_features by 16; .* is 64 x 40"),
     (replace(MACHINE, kernels=True), (40, 64), "in_features divisible by 32; .* is 64 x 40")],
    ids=["torch, outputs", "torch, inputs", "panels, inputs"],
)  # fmt: skip
def test_int4_refuses_shapes_the_kernel_cannot_hold_and_changes_nothing(machine, shape, message):
    """torch's int4 kernel needs whole groups of inputs and tiles of outputs; the panels whole groups only."""
    model = AutoModelForCausalLM.from_config(tiny_llama_config()).eval()
    model.model.layers[1].mlp.odd = nn.Linear(*shape, bias=False)
    decoder, head = planning.linears(Flags(weights="int4"), "int4", machine)
    with pytest.raises(ValueError, match=f"{message}: use --weights int8") as refused:
        replace_linears(model, decoder, head)
    assert "'LlamaMLP.odd'" in str(refused.value)
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert replace_linears(model, *planning.linears(Flags(weights="int8"), "int8", MACHINE)) > 0


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_loader_quantises_and_names_the_mode(tmp_path, mode):
    model, spec = load(str(save_tiny_llama(tmp_path / "tiny")), torch.float32, weights=mode)
    assert spec.weights == mode and spec.dtype_name == "float32"
    assert all(not isinstance(m, nn.Linear) for m in model.modules())
    assert spec.plan.decoder_linears.weights == mode and spec.plan.head_linear.weights == "int8"


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
