"""KV dtypes independent of the weights: quantize/dequantize bounds, the cpu backend's write/read path on a
pool of each dtype against the float32 reference, fp8 scale calibration, refusals, and block counts."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cache_service.kv_pool import KVPool, kv_identity, spec_from_request
from common.errors import FailedPrecondition, InvalidArgument
from common.precision import KV_DTYPE_CHOICES, resolve_kv_dtype
from common.shared_pool import DTYPES, dtype_from_name, dtype_name
from compute_service.attention import registry
from compute_service.attention.context import build_context, reset_context, set_context
from compute_service.attention.cpu import paged_attention
from compute_service.attention.kv_codec import NO_SCALES, KVScales, dequantize, quantize, round_trip
from compute_service.attention.reference import reference_attention
from compute_service.batch import ForwardBatch
from compute_service.kv_calibration import MARGIN, calibrate, power_of_two_scale
from compute_service.model_loader import register_attention
from compute_service.validation import Limits
from protos import cache_pb2
from tests.forward import forward_request
from tests.tiny_model import save_tiny_llama

FP8 = ("fp8_e4m3", "fp8_e5m2")
# Relative error of one rounding to nearest: half a unit in the last place of the mantissa.
RELATIVE = {"float32": 0.0, "bfloat16": 2**-8, "float16": 2**-11, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}
# Attention outputs on a pool of each dtype vs float32 K/V (random data of unit scale).
ATTENTION_TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2}
BLOCK_SIZE, NUM_BLOCKS, HEADS, KV_HEADS, HEAD_DIM = 4, 32, 6, 2, 8
SCALE = HEAD_DIM**-0.5
ALLOCATOR = "freelist"


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def scale_for(name: str, x: torch.Tensor) -> float:
    return power_of_two_scale(x.abs().max().item(), DTYPES[name]) if name in FP8 else 1.0


@pytest.mark.parametrize("name", list(DTYPES))
def test_round_trip_error_is_one_rounding(name):
    x = torch.randn(4096) * 3
    scale = scale_for(name, x)
    stored = quantize(x, DTYPES[name], scale)
    assert stored.dtype == DTYPES[name]
    back = dequantize(stored, torch.float32, scale)
    # below the smallest normal the format is absolute-spaced: allow one such step
    floor = scale * torch.finfo(DTYPES[name]).smallest_normal
    assert ((back - x).abs() <= RELATIVE[name] * x.abs() + floor).all()
    assert torch.equal(round_trip(x, DTYPES[name], scale), back)


def test_float32_pool_for_float32_compute_is_untouched():
    x = torch.randn(8, 2, 4)
    assert quantize(x, torch.float32) is x and dequantize(x, torch.float32) is x


@pytest.mark.parametrize("name", ["float16", *FP8])
def test_writes_saturate_instead_of_overflowing(name):
    limit = torch.finfo(DTYPES[name]).max
    x = torch.tensor([1e9, -1e9, 3 * limit, float(limit)])
    back = dequantize(quantize(x, DTYPES[name], 2.0), torch.float32, 2.0)
    assert back.isfinite().all()
    assert back.tolist() == [2 * limit, -2 * limit, 2 * limit, limit]


def test_power_of_two_scales_fit_the_margin():
    for name in FP8:
        top = torch.finfo(DTYPES[name]).max
        for amax in (1e-3, 0.7, 13.0, 5000.0):
            scale = power_of_two_scale(amax, DTYPES[name])
            assert scale == 2.0 ** round(torch.tensor(scale).log2().item())
            assert amax * MARGIN / scale <= top < 2 * amax * MARGIN / scale
        assert power_of_two_scale(0.0, DTYPES[name]) == 1.0
        with pytest.raises(ValueError, match="non-finite"):
            power_of_two_scale(float("inf"), DTYPES[name])


def test_scales_identity_is_exact():
    a = KVScales((0.5, 1.0), (2.0, 4.0))
    assert a.identity == KVScales((0.5, 1.0), (2.0, 4.0)).identity != ""
    assert a.identity != KVScales((0.5, 1.0), (2.0, 8.0)).identity
    assert a.identity != KVScales((2.0, 4.0), (0.5, 1.0)).identity
    assert NO_SCALES.identity == "" and NO_SCALES.of_layer(3) == (1.0, 1.0)


def step(name: str, lengths: list[int], cached: list[int], pool, scales: tuple[float, float], kv):
    """One packed step of `lengths[i] - cached[i]` new tokens per sequence (sequence i owns blocks
    [8i, 8i + 8)) on a pool of dtype `name`; returns the output [T, H, D]."""
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(lengths))]
    new = [n - c for n, c in zip(lengths, cached, strict=True)]
    request = forward_request([[0] * n for n in new], cached, tables, block_size=BLOCK_SIZE)
    forward = ForwardBatch.from_request(request, Limits(1, 8 * BLOCK_SIZE, NUM_BLOCKS, BLOCK_SIZE))
    q = torch.cat([kv["q"][i][c:n] for i, (c, n) in enumerate(zip(cached, lengths, strict=True))])
    k = torch.cat([kv["k"][i][c:n] for i, (c, n) in enumerate(zip(cached, lengths, strict=True))])
    v = torch.cat([kv["v"][i][c:n] for i, (c, n) in enumerate(zip(cached, lengths, strict=True))])
    k_cache, v_cache = pool
    layer_scales = KVScales((scales[0],), (scales[1],)) if name in FP8 else NO_SCALES
    set_context(build_context([k_cache], [v_cache], forward, layer_scales))
    try:
        out = paged_attention(
            SimpleNamespace(layer_idx=0),
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            None,
            scaling=SCALE,
        )[0][0]
    finally:
        reset_context()
    # the pool holds the quantized K/V at their slots (bytes compared: fp8 has no equality kernel)
    slots = forward.slot_mapping
    stored = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
    assert torch.equal(stored.view(torch.uint8), quantize(k, DTYPES[name], scales[0]).view(torch.uint8))
    # reads are exactly the dequantized pool: the float32 reference over it agrees to float32 rounding
    pool32 = [dequantize(c, torch.float32, s) for c, s in zip(pool, scales, strict=True)]
    reference = reference_attention(
        q, *pool32, forward.cu_seqlens_q, forward.context_lens, forward.block_tables, SCALE
    )
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-4)
    return out


def dense(kv, lengths: list[int], cached: list[int]) -> torch.Tensor:
    rows = []
    for i, (c, n) in enumerate(zip(cached, lengths, strict=True)):
        q, k, v = (kv[t][i][:n].transpose(0, 1)[None] for t in ("q", "k", "v"))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
        rows.append(o[0].transpose(0, 1)[c:])
    return torch.cat(rows)


@pytest.mark.parametrize("name", list(DTYPES))
def test_attention_on_each_pool_dtype_is_near_float32(name):
    lengths = [13, 7, 25]
    kv = {
        t: [torch.randn(n, HEADS if t == "q" else KV_HEADS, HEAD_DIM) for n in lengths]
        for t in ("q", "k", "v")
    }
    scales = tuple(scale_for(name, torch.cat(kv[t])) for t in ("k", "v"))
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    pool = (torch.zeros(shape, dtype=DTYPES[name]), torch.zeros(shape, dtype=DTYPES[name]))
    prompts = [n - 3 for n in lengths]
    out = step(name, prompts, [0, 0, 0], pool, scales, kv)  # fresh prompts
    tol = ATTENTION_TOL[name]
    torch.testing.assert_close(out, dense(kv, prompts, [0, 0, 0]), atol=tol, rtol=tol)
    chunk = [n - 1 for n in lengths]
    out = step(name, chunk, prompts, pool, scales, kv)  # chunks on cached K/V
    torch.testing.assert_close(out, dense(kv, chunk, prompts), atol=tol, rtol=tol)
    out = step(name, lengths, chunk, pool, scales, kv)  # decodes
    torch.testing.assert_close(out, dense(kv, lengths, chunk), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def tiny_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=register_attention("cpu")
    ).eval()


@pytest.mark.parametrize("name", FP8)
def test_calibration_is_deterministic_across_loads_and_thread_counts(tiny_dir, name):
    threads = torch.get_num_threads()
    first = calibrate(tiny_model(tiny_dir), tiny_dir, DTYPES[name])
    try:
        torch.set_num_threads(1)
        again = calibrate(tiny_model(tiny_dir), tiny_dir, DTYPES[name])
    finally:
        torch.set_num_threads(threads)
    assert first == again and first.identity == again.identity
    assert len(first.k) == len(first.v) == 2
    assert calibrate(tiny_model(tiny_dir), tiny_dir, torch.float16) == NO_SCALES


def test_kv_dtype_names_and_auto():
    assert set(KV_DTYPE_CHOICES) == {"auto", *DTYPES}
    for name in DTYPES:
        assert dtype_name(dtype_from_name(name)) == name
    assert resolve_kv_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_kv_dtype("fp8_e5m2", "float32") == "fp8_e5m2"


def test_a_backend_that_cannot_store_a_dtype_is_refused(monkeypatch):
    monkeypatch.setitem(registry.KV_DTYPES, "narrow", ("float32", "bfloat16"))
    with pytest.raises(ValueError, match="'narrow' cannot store K/V as fp8_e4m3; choose --kv-dtype auto or"):
        registry.require_kv_dtype("narrow", "fp8_e4m3")
    registry.require_kv_dtype("cpu", "fp8_e4m3")


def pool_request(kv_dtype: str, scales_id: str = "", **budget) -> cache_pb2.CreatePoolRequest:
    geometry = cache_pb2.PoolGeometry(num_layers=30, num_kv_heads=3, head_dim=64)
    return cache_pb2.CreatePoolRequest(
        geometry=geometry, block_size=16, kv_dtype=kv_dtype, kv_scales_id=scales_id, **budget
    )


def test_blocks_per_dtype_from_the_same_budget():
    memory = 256 * 2**20
    blocks = {
        name: spec_from_request(pool_request(name, "s" if name in FP8 else ""), 0, memory).num_blocks
        for name in DTYPES
    }
    assert blocks["float32"] == memory // (30 * 2 * 16 * 3 * 64 * 4) == 364
    assert blocks["bfloat16"] == blocks["float16"] == 2 * 364
    assert blocks["fp8_e4m3"] == blocks["fp8_e5m2"] == 4 * 364


def test_fp8_pools_need_their_scales_identity_and_others_refuse_one():
    with pytest.raises(InvalidArgument, match="an fp8_e4m3 pool needs kv_scales_id"):
        spec_from_request(pool_request("fp8_e4m3"), 4, 0)
    with pytest.raises(InvalidArgument, match="kv_scales_id is for fp8 pools only"):
        spec_from_request(pool_request("float16", "abc"), 4, 0)
    with pytest.raises(InvalidArgument, match="at most 64 ASCII"):
        spec_from_request(pool_request("fp8_e5m2", "x" * 65), 4, 0)


def test_a_pool_keeps_its_scales_and_hashes_differ_by_encoding():
    spec = spec_from_request(pool_request("fp8_e4m3", "aaaa"), 4, 0)
    pool = KVPool.create(spec, "m", ALLOCATOR, True, "aaaa")
    try:
        assert pool.handle.kv_scales_id == "aaaa" and pool.handle.dtype == "fp8_e4m3"
        pool.require_layout(spec, "m", "aaaa")
        with pytest.raises(FailedPrecondition, match="fp8_e4m3, kv scales aaaa, model 'm'"):
            pool.require_layout(spec, "m", "bbbb")
    finally:
        pool.release()
    identities = {
        kv_identity("m", DTYPES[name], scales) for name in DTYPES for scales in ("", "aaaa", "bbbb")
    }
    assert len(identities) == 3 * len(DTYPES)


def test_the_report_counts_agreement_until_the_first_divergence_and_overall():
    from cli.kv_report import agreement

    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert agreement(reference, reference) == (8, 8, 8)
    assert agreement([[1, 9, 3, 4], [5, 6, 7, 0]], reference) == (1 + 3, 6, 8)
