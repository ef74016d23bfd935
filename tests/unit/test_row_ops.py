"""The native decoder stack's row-wise ops on prompt steps (compute_service.llama_layer.native_row_ops,
decode_layers.cpp's rms_norm_rows, rotate_rows and silu_mul_rows) against torch's: the same values at any row
count and thread split, their input checks, and the loader's choice of them."""

import re

import pytest
import torch
from torch import nn

from compute_service import kernels
from compute_service.batch import ForwardBatch
from compute_service.llama_layer import TORCH_ROW_OPS, native_row_ops, rope_tables
from compute_service.model_loader import load
from compute_service.runner import Runner
from compute_service.validation import Limits
from tests.forward import forward_request
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the native kernels cannot be built here")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 96, 6, 2, 16
# 1 row, a few, and enough for the loops to split across threads (decode_layers.cpp for_rows)
ROWS = [1, 5, 700]


@pytest.fixture(scope="module")
def native():
    return native_row_ops(kernels.load())


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request, torch_threads):
    torch.set_num_threads(request.param)


def norm(width: int) -> nn.Module:
    module = nn.Module()
    module.weight, module.variance_epsilon = torch.randn(width), 1e-6
    return module


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_equals_torchs(native, threads, rows):
    torch.manual_seed(rows)
    x, layer_norm = torch.randn(rows, HIDDEN) * 3, norm(HIDDEN)
    torch.testing.assert_close(native.rms_norm(x, layer_norm), TORCH_ROW_OPS.rms_norm(x, layer_norm))


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_equals_torchs_over_the_exponents_whole_range(native, threads, rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * HIDDEN) * 4
    gate_up[0, :4] = torch.tensor([-120.0, -90.0, 90.0, 120.0])  # beyond the clamp of vec::fast_exp
    got, expected = native.silu_mul(gate_up), TORCH_ROW_OPS.silu_mul(gate_up)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_silu_mul_keeps_a_nan_gate_nan(native):
    gate_up = torch.ones(2, 2 * HIDDEN)
    gate_up[1, 3] = float("nan")
    out = native.silu_mul(gate_up)
    assert out[1, 3].isnan() and not out[0].isnan().any() and out.isnan().sum() == 1


@pytest.mark.parametrize("rows", ROWS)
def test_rotate_of_the_qk_part_of_a_fused_projection_equals_torchs_in_place(native, threads, rows):
    # NOTE: q and k are a view of the fused QKV output: rows HIDDEN + 2 KV heads apart, v left after them.
    torch.manual_seed(rows)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].clone()
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].reshape(rows, -1, HEAD_DIM)
    angles = torch.arange(rows)[:, None] * torch.rand(HEAD_DIM // 2)
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1) for f in (torch.cos, torch.sin))
    rope = rope_tables(cos, sin)
    expected = TORCH_ROW_OPS.rotate(qk, *rope)
    got = native.rotate(qk, *rope)
    assert got.data_ptr() == qk.data_ptr(), "rotated in place"
    torch.testing.assert_close(got, expected)
    assert torch.equal(qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :], v), "v untouched"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m.rms_norm_rows(torch.randn(4, 8).t(), torch.randn(4), 1e-6), "contiguous float32"),
        (lambda m: m.rms_norm_rows(torch.randn(4, 8), torch.randn(7), 1e-6), "weight: float32 [width]"),
        (lambda m: m.silu_mul_rows(torch.randn(4, 7)), "gate_up"),
        (lambda m: m.silu_mul_rows(torch.randn(4, 8, dtype=torch.float64)), "gate_up"),
        (lambda m: m.rotate_rows(torch.randn(4, 2, 8), torch.randn(4, 6), torch.randn(4, 8)),
         "cos, signed_sin"),
        (lambda m: m.rotate_rows(torch.randn(4, 8, 2).transpose(1, 2), torch.randn(4, 8), torch.randn(4, 8)),
         "each row's heads contiguous"),
    ],
    ids=["strided x", "weight width", "odd gate_up", "float64", "short cos", "strided heads"],
)  # fmt: skip
def test_bad_inputs_are_refused_with_what_the_op_takes(call, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        call(kernels.load())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", initializer_range=0.3))


def test_the_loader_gives_the_native_ops_where_the_plan_runs_the_native_stack(tiny):
    model, spec = load(tiny, torch.float32, backend="cpu-native")
    assert spec.plan.native_decode and model.model.row_ops != TORCH_ROW_OPS
    assert "RMSNorm, rotary and SiLU" in spec.plan.decode_layers.reason
    model, spec = load(tiny, torch.float32, backend="cpu")
    assert not spec.plan.native_decode and model.model.row_ops == TORCH_ROW_OPS


def test_a_packed_prompt_step_gives_torchs_logits_and_greedy_tokens(tiny):
    model, _ = load(tiny, torch.float32, backend="cpu-native")
    config = model.config
    shape = (config.num_hidden_layers, 2, 64, 4, config.num_key_value_heads, config.head_dim)
    runner = Runner(model)
    runner.attach(torch.zeros(shape))
    limits = Limits(config.vocab_size, config.max_position_embeddings, 64, 4)
    torch.manual_seed(0)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (9, 30, 17)]
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    batch = ForwardBatch.from_request(forward_request(prompts, [0, 0, 0], tables, block_size=4), limits)
    native = model.model.row_ops
    got = runner.logits(batch)
    model.model.row_ops = TORCH_ROW_OPS
    expected = runner.logits(batch)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert native != TORCH_ROW_OPS
