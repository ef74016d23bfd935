"""The one linear layer (compute_service.linear) on each dense kernel (compute_service.linear_kernels): the
same product as nn.Linear on a weight packed once (float32 panels for the native kernel, oneDNN's layout in
float32 or bfloat16), at every batch size; the panel kernel itself; and the loader replacing a model's
linears as its execution plan says."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from compute_service import kernels, planning
from compute_service.batch import ForwardBatch
from compute_service.linear import Linear, kernel_for, replace_linears
from compute_service.linear_kernels import PACK_ROWS, OneDnn, Panels, WeightOnly
from compute_service.model_loader import load
from compute_service.plan import ONEDNN, PANELS, TRANSFORMERS, LinearChoice
from compute_service.planning import Flags
from compute_service.runner import Runner
from compute_service.validation import Limits
from tests.forward import forward_request
from tests.tiny_model import needs_native_bfloat16, save_tiny_llama, tiny_llama_config

MACHINE = planning.this_machine()
# The float32 linears this machine runs (panels where the kernels build), and oneDNN's, as a machine where
# they do not build runs them.
FLOAT32 = planning.dense_linears(Flags(), "float32", MACHINE)
ONEDNN_FLOAT32 = LinearChoice(ONEDNN, "float32", "a machine without the native kernels")


def linear_on(linear: nn.Linear, choice: LinearChoice = FLOAT32) -> Linear:
    return Linear(kernel_for(linear.weight, choice), linear.bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 7, PACK_ROWS, PACK_ROWS + 1, 300])
def test_equals_f_linear_at_any_batch_size(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(1, rows, 64)
    out = linear_on(linear)(x)
    assert out.shape == (1, rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


INT8_ONES = torch.ones(20, 8, dtype=torch.int8)
needs_native = pytest.mark.skipif(kernels.load() is None, reason="the native kernels cannot be built here")


@needs_native
def test_float32_weights_pack_into_native_panels_where_the_kernels_build():
    assert FLOAT32.kernel == PANELS
    packed = linear_on(nn.Linear(64, 96))
    assert isinstance(packed.kernel, Panels) and "float32 panels" in repr(packed)
    width = kernels.load().panel_width()
    assert packed.kernel.packed.shape == (-(-96 // width), 64, width)


@pytest.mark.parametrize("rows", [1, 7, PACK_ROWS + 1])
def test_without_the_native_kernels_float32_weights_run_on_onednn(rows):
    assert planning.dense_linears(Flags(), "float32", replace(MACHINE, kernels=False)) == replace(
        ONEDNN_FLOAT32, reason="the native kernels cannot be built here: oneDNN, packed once"
    )
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96)
    packed = linear_on(linear, ONEDNN_FLOAT32)
    assert isinstance(packed.kernel, OneDnn) and packed.kernel.packed.is_mkldnn and "onednn" in repr(packed)
    x = torch.randn(rows, 64)
    torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 11, 12, 13, 16, 25, 96, 97, 200])
@pytest.mark.parametrize("shape", [(37, 70), (64, 32), (1536, 20)], ids=["ragged", "one panel", "wide in"])
def test_panels_give_f_linear_for_every_tile_and_a_partial_last_panel(rows, bias, shape):
    """Rows split into tiles of every size (up to 12 on AVX-512, 6 on AVX2) and row blocks of 96; outputs
    that leave the last panel part empty; an input width that is no multiple of anything."""
    torch.manual_seed(rows)
    in_features, out_features = shape
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)
    module = kernels.load()
    panels = module.pack_panels(linear.weight.detach())
    out = module.panel_linear(x, panels, out_features, linear.bias, None)
    assert out.shape == (rows, out_features) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 5, 12, 13, 97, 200])
@pytest.mark.parametrize("shape", [(37, 70), (64, 32), (1536, 20)], ids=["ragged", "one panel", "wide in"])
def test_int8_panels_give_f_linear_on_the_scaled_weights(rows, bias, shape):
    """int8 weights widened in registers, each output column's sum times its scale, then the bias: the
    product F.linear gives on the dequantised weights, at every tile size and a partial last panel."""
    torch.manual_seed(rows)
    out_features, in_features = shape
    levels = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    scales = torch.rand(out_features) / 100
    b = torch.randn(out_features) if bias else None
    x = torch.randn(rows, in_features)
    module = kernels.load()
    out = module.panel_linear(x, module.pack_panels(levels), out_features, b, scales)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, F.linear(x, levels.float() * scales[:, None], b), atol=1e-5, rtol=1e-5)


def int4_parts(out_features: int, in_features: int, group: int) -> tuple[torch.Tensor, ...]:
    """Random int4 levels [out, in] and their groups' scales and zero points [out, in / group] (bfloat16
    values, as compute_service/quantized.py rounds them), and the float32 weights they stand for."""
    levels = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    scales = (torch.rand(out_features, in_features // group) / 50).bfloat16().float()
    zeros = (torch.randn(out_features, in_features // group) / 20).bfloat16().float()
    steps = (levels.float() - 8).view(out_features, -1, group)
    return levels, scales, zeros, (steps * scales[..., None] + zeros[..., None]).flatten(1)


@needs_native
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12, 13, 97, 200])
@pytest.mark.parametrize(
    ("shape", "group"),
    [((37, 64), 32), ((64, 32), 32), ((70, 1536), 64), ((20, 12), 2)],
    ids=["ragged", "one panel", "wide in", "pairs"],
)
def test_int4_panels_give_f_linear_on_the_dequantised_weights(rows, bias, shape, group):
    """Two int4 levels a byte, each group's scale and zero point: the product F.linear gives on the weights
    they stand for, whether the tiles read the levels directly (a few rows) or widen each panel once (more),
    at every tile size and a partial last panel."""
    torch.manual_seed(rows)
    out_features, in_features = shape
    levels, scales, zeros, weight = int4_parts(out_features, in_features, group)
    b = torch.randn(out_features) if bias else None
    x = torch.randn(rows, in_features)
    module = kernels.load()
    panels, groups = module.pack_int4_panels(levels, scales, zeros)
    assert panels.dtype == torch.uint8 and panels.numel() == -(-out_features // module.panel_width()) * (
        module.panel_width() * in_features // 2
    )
    out = module.panel_linear(x, panels, out_features, b, groups)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, F.linear(x, weight, b), atol=2e-5, rtol=1e-5)


UINT8_ONES = torch.ones(20, 8, dtype=torch.uint8)


@needs_native
@pytest.mark.parametrize(
    "levels, scales, message",
    [
        (torch.full((20, 8), 16, dtype=torch.uint8), torch.ones(20, 1), r"int4 levels must lie in \[0, 15\]"),
        (torch.ones(20, 8, dtype=torch.int8), torch.ones(20, 1), "takes uint8 levels"),
        (UINT8_ONES, torch.ones(20, 3), "groups dividing in_features"),
        (torch.ones(20, 6, dtype=torch.uint8), torch.ones(20, 2), "groups of an even size"),
        (UINT8_ONES, torch.ones(19, 1), r"scales and zeros must be \[out, groups\]"),
        (UINT8_ONES, torch.full((20, 1), 0.1), "scales and zeros must be bfloat16 values"),
    ],
    ids=["level 16", "int8", "groups", "odd group", "short", "not bfloat16"],
)  # fmt: skip
def test_int4_packing_refuses_what_it_cannot_hold(levels, scales, message):
    with pytest.raises(RuntimeError, match=message):
        kernels.load().pack_int4_panels(levels, scales, torch.zeros_like(scales))


@needs_native
def test_int4_panels_take_their_own_groups_only():
    module = kernels.load()
    levels, scales, zeros, _ = int4_parts(20, 8, 2)
    panels, groups = module.pack_int4_panels(levels, scales, zeros)
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="int8 and int4 panels take scales"):
        module.panel_linear(x, panels, 20, None, None)
    with pytest.raises(RuntimeError, match="int4 scales must be the groups pack_int4_panels returned"):
        module.panel_linear(x, panels, 20, None, torch.ones(20))
    with pytest.raises(RuntimeError, match="int4 scales must be the groups"):
        module.panel_linear(x, panels, 20, None, groups[:, :3].contiguous())


@needs_native
def test_panels_of_no_rows_give_no_rows():
    module = kernels.load()
    out = module.panel_linear(torch.empty(0, 8), module.pack_panels(torch.randn(20, 8)), 20, None, None)
    assert out.shape == (0, 20)


@needs_native
@pytest.mark.parametrize(
    "x, out_features, bias, message",
    [
        (torch.randn(3, 9), 20, None, r"x must be contiguous float32 \[rows, in_features\]"),
        (torch.randn(8, 3).t(), 20, None, r"x must be contiguous float32"),
        (torch.randn(3, 8, dtype=torch.float64), 20, None, r"x must be contiguous float32"),
        (torch.randn(3, 8), 64, None, "out_features does not match the panels"),
        (torch.randn(3, 8), 20, torch.randn(19), r"bias must be float32 \[out_features\]"),
    ],
    ids=["in width", "strided", "float64", "out", "bias"],
)
def test_panels_refuse_inputs_that_do_not_fit(x, out_features, bias, message):
    module = kernels.load()
    with pytest.raises(RuntimeError, match=message):
        module.panel_linear(x, module.pack_panels(torch.randn(20, 8)), out_features, bias, None)


@needs_native
@pytest.mark.parametrize(
    "weight, scales, message",
    [
        (INT8_ONES, None, "int8 and int4 panels take scales, float32 panels none"),
        (torch.ones(20, 8), torch.ones(20), "int8 and int4 panels take scales, float32 panels none"),
        (INT8_ONES, torch.ones(19), r"scales must be contiguous float32 \[out_features\]"),
        (INT8_ONES, torch.ones(20).half(), r"scales must be contiguous float32"),
    ],
    ids=["int8 without", "float32 with", "short", "float16"],
)  # fmt: skip
def test_panels_take_scales_with_int8_weights_only(weight, scales, message):
    module = kernels.load()
    with pytest.raises(RuntimeError, match=message):
        module.panel_linear(torch.randn(3, 8), module.pack_panels(weight), 20, None, scales)


@needs_native
def test_only_float32_and_int8_weights_pack_into_panels():
    with pytest.raises(RuntimeError, match="pack_panels takes a float32 or int8 CPU weight"):
        kernels.load().pack_panels(torch.ones(20, 8, dtype=torch.float64))


@needs_native_bfloat16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, PACK_ROWS + 1, 300])
def test_bfloat16_packing_multiplies_bfloat16_rounded_inputs_and_weights(rows, bias):
    """Mixed precision: float32 in and out, the product of the bfloat16-rounded input and weight accumulated
    in float32 (so equal to float32 arithmetic on the rounded values), float32 bias added."""
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(1, rows, 64)
    choice = planning.dense_linears(Flags(), "bfloat16", MACHINE)
    assert (choice.kernel, choice.weights) == (ONEDNN, "bfloat16")
    packed = linear_on(linear, choice)
    out = packed(x)
    assert out.dtype == torch.float32 and out.shape == (1, rows, 96)
    rounded = F.linear(x.bfloat16().float(), linear.weight.bfloat16().float(), linear.bias)
    # NOTE: the float32 product is rounded to bfloat16 once on the way out (oneDNN's output is bfloat16).
    torch.testing.assert_close(out, rounded, atol=2e-2, rtol=1e-2)
    exact = F.linear(x, linear.weight, linear.bias)
    assert (out - exact).abs().max() > 0, "the weights are held in bfloat16, not float32"
    assert "bfloat16" in repr(packed)


def test_bfloat16_packing_is_refused_where_the_cpu_would_emulate_it():
    emulating = replace(MACHINE, bfloat16_native=False)
    with pytest.raises(ValueError, match="need a cpu with AVX512-BF16 or AMX"):
        planning.check(Flags(weights="bfloat16"), emulating)


@needs_native_bfloat16
def test_the_loader_packs_bfloat16_weights_in_a_float32_model(tmp_path):
    path = str(save_tiny_llama(tmp_path / "tiny", initializer_range=0.3))
    model, spec = load(path, torch.float32, weights="bfloat16")
    packed = [m.kernel for m in model.modules() if isinstance(m, Linear)]
    assert packed and all(isinstance(k, OneDnn) and k.dtype == torch.bfloat16 for k in packed)
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


@pytest.mark.parametrize("choice", [FLOAT32, ONEDNN_FLOAT32], ids=["this machine", "onednn"])
def test_takes_a_strided_input(choice):
    linear = nn.Linear(64, 96, bias=False)
    x = torch.randn(64, 5).t()
    torch.testing.assert_close(linear_on(linear, choice)(x), linear(x), atol=1e-5, rtol=1e-5)


def test_replaces_every_linear_and_keeps_the_tied_embedding():
    model = AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True)).eval()
    embedding = model.get_input_embeddings().weight
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert replace_linears(model, FLOAT32, FLOAT32) == linears > 0
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.get_input_embeddings().weight is embedding, "the embedding keeps the plain weight"
    assert replace_linears(model, FLOAT32, FLOAT32) == 0


def test_a_transformers_choice_keeps_nn_linear():
    model = AutoModelForCausalLM.from_config(tiny_llama_config()).eval()
    kept = LinearChoice(TRANSFORMERS, "float32", "--plain-linear")
    assert replace_linears(model, kept, kept) == 0
    assert replace_linears(model, kept, FLOAT32) == 1, "the output head alone"
    assert isinstance(model.lm_head, Linear) and type(model.model.layers[0].mlp.up_proj) is nn.Linear


@pytest.mark.parametrize("choice", [FLOAT32, ONEDNN_FLOAT32], ids=["this machine", "onednn"])
def test_a_replaced_model_gives_the_same_logits(choice):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(initializer_range=0.3)).eval()
    ids = torch.randint(3, 256, (1, 12))
    with torch.inference_mode():
        expected = model(ids).logits
        replace_linears(model, choice, choice)
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("plain", [False, True])
def test_the_loader_packs_unless_plain_linear_is_asked(tmp_path, plain):
    model, spec = load(str(save_tiny_llama(tmp_path / "tiny")), torch.float32, plain_linear=plain)
    kinds = {type(module) for module in model.modules() if isinstance(module, (nn.Linear, Linear))}
    assert kinds == ({nn.Linear} if plain else {Linear})
    assert spec.plan.decoder_linears == (
        replace(FLOAT32, kernel=TRANSFORMERS, reason="--plain-linear") if plain else FLOAT32
    )


def test_the_loader_holds_int4_linears_without_a_dense_copy_where_the_kernels_build(tmp_path):
    """A float32 model's int4 linears: half a byte per weight on panels (the head int8) where the native
    kernels build; elsewhere torch's int4 kernel, with the dequantised weights packed for larger batches."""
    model, _ = load(str(save_tiny_llama(tmp_path / "tiny")), torch.float32, weights="int4")
    held = [m.kernel for m in model.modules() if isinstance(m, Linear)]
    assert held and not any(type(m) is nn.Linear for m in model.modules())
    if FLOAT32.kernel == PANELS:
        assert all(isinstance(kernel, Panels) for kernel in held)
        assert [kernel.packed.dtype for kernel in held].count(torch.int8) == 1  # the output head
        assert all(kernel.packed.dtype in (torch.uint8, torch.int8) for kernel in held)
    else:
        assert all(isinstance(kernel, WeightOnly) and type(kernel.dense) is OneDnn for kernel in held)
