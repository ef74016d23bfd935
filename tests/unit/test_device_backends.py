"""The cuda and npu attention backends' arguments, built on the CPU and checked against pure-torch
implementations of their kernels' documented semantics, which must reproduce the cpu backend (and the dense
reference) on the same batch; and how a backend is chosen and refused per device. The kernels themselves
run in tests/unit/test_cuda.py (skipped without a GPU) and on Ascend hosts only."""

import sys

import pytest
import torch

from compute_service import kernels, planning
from compute_service.architectures import FULL, LayerAttention
from compute_service.attention import cpu, cuda, cuda_args, npu_args, registry
from compute_service.attention.reference import reference_attention
from compute_service.batch import ForwardBatch
from compute_service.validation import Limits
from tests.device_steps import HEAD_DIM, HEADS, KV_HEADS, PATTERNS, SCALE, SCENARIOS, make_step, run_backend
from tests.forward import forward_request

TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}


def varlen_args(step):
    b = step.batch
    return cuda_args.build_varlen_args(b.cu_seqlens_q, b.context_lens, b.block_tables, b.slot_mapping)


def fias_args(step, block_size):
    b = step.batch
    heads = (HEADS, KV_HEADS)
    return npu_args.build_fias_args(
        b.cu_seqlens_q, b.context_lens, b.block_tables, b.slot_mapping, heads, block_size, SCALE
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_cuda_arguments_reproduce_the_cpu_backend(scenario):
    step = make_step(*SCENARIOS[scenario], block_size=4)
    b = step.batch
    args = varlen_args(step)
    out = cuda_args.paged_varlen_attention(step.q, step.k_after, step.v_after, args, SCALE)
    torch.testing.assert_close(out, step.out, **TOLERANCE)
    dense = reference_attention(
        step.q, step.k_after, step.v_after, b.cu_seqlens_q, b.context_lens, b.block_tables, SCALE
    )
    torch.testing.assert_close(out, dense, **TOLERANCE)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_cuda_window_and_softcap_arguments_reproduce_the_cpu_backend(scenario, pattern):
    attends = PATTERNS[pattern]
    step = make_step(*SCENARIOS[scenario], block_size=4, attends=attends)
    b = step.batch
    window_size = cuda_args.flash_window(attends.window)
    out = cuda_args.paged_varlen_attention(
        step.q, step.k_after, step.v_after, varlen_args(step), SCALE, window_size, attends.softcap
    )
    torch.testing.assert_close(out, step.out, **TOLERANCE)
    dense = reference_attention(
        step.q, step.k_after, step.v_after, b.cu_seqlens_q, b.context_lens, b.block_tables, SCALE,
        attends.window, attends.softcap,
    )  # fmt: skip
    torch.testing.assert_close(out, dense, **TOLERANCE)
    k_pool, v_pool = step.k_before.clone(), step.v_before.clone()
    through = run_backend(cuda.paged_attention, step.q, step.k, step.v, b, k_pool, v_pool, attends)
    torch.testing.assert_close(through, step.out, **TOLERANCE)


def test_flash_windows_count_the_keys_left_of_the_diagonal():
    assert cuda_args.flash_window(0) == (-1, -1), "no window"
    assert cuda_args.flash_window(1) == (0, 0), "a query's own key only"
    assert cuda_args.flash_window(4096) == (4095, 0)


def test_the_cuda_arguments_are_what_flash_attn_varlen_takes():
    step = make_step(*SCENARIOS["mixed"], block_size=4)
    args = varlen_args(step)
    for name in ("cu_seqlens_q", "cu_seqlens_k", "block_table"):
        assert getattr(args, name).dtype == torch.int32, name
    assert args.cu_seqlens_q.tolist() == [0, 1, 7, 10, 11]
    assert args.cu_seqlens_k.tolist() == [0, 10, 16, 24, 27], "cumulative context lengths"
    assert (args.max_seqlen_q, args.max_seqlen_k) == (6, 10)
    assert args.block_table.shape == step.batch.block_tables.shape and args.block_table.min() >= 0
    assert args.slot_mapping.dtype == torch.int64 and torch.equal(args.slot_mapping, step.batch.slot_mapping)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_cuda_backend_on_the_cpu_writes_and_attends_as_the_cpu_backend(scenario):
    step = make_step(*SCENARIOS[scenario], block_size=4, dtype=torch.bfloat16)
    k_pool, v_pool = step.k_before.clone(), step.v_before.clone()
    out = run_backend(cuda.paged_attention, step.q, step.k, step.v, step.batch, k_pool, v_pool)
    assert torch.equal(k_pool, step.k_after) and torch.equal(v_pool, step.v_after), "same writes by slot"
    torch.testing.assert_close(out, step.out, atol=2e-2, rtol=2e-2)


def test_flash_attn_is_chosen_only_where_it_can_run():
    cuda_device, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert cuda_args.flash_usable(cuda_device, torch.bfloat16, torch.bfloat16, 256)
    assert cuda_args.flash_usable(cuda_device, torch.float16, torch.float16, 512)
    assert not cuda_args.flash_usable(cuda_device, torch.bfloat16, torch.bfloat16, 16), "pages of 256 tokens"
    assert not cuda_args.flash_usable(cuda_device, torch.float32, torch.float32, 256), "half precision"
    assert not cuda_args.flash_usable(cuda_device, torch.bfloat16, torch.float16, 256), "pool dtype = q dtype"
    assert not cuda_args.flash_usable(cpu, torch.bfloat16, torch.bfloat16, 256)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size", [128, 256])
def test_the_npu_arguments_reproduce_the_cpu_backend(scenario, block_size):
    new, cached = SCENARIOS[scenario]
    step = make_step(new, [c * 23 for c in cached], block_size=block_size)
    args = fias_args(step, block_size)
    blocks = step.k_after.shape[0]
    out = npu_args.fused_infer_attention_reference(
        step.q,
        step.k_after.view(blocks, block_size, -1),
        step.v_after.view(blocks, block_size, -1),
        **args.attention_kwargs(),
    )
    torch.testing.assert_close(out, step.out, **TOLERANCE)


@pytest.mark.parametrize("window", [3, 7, 40])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_npu_band_arguments_reproduce_the_cpu_backend_under_a_window(scenario, window):
    new, cached = SCENARIOS[scenario]
    step = make_step(new, [c * 23 for c in cached], block_size=128, attends=LayerAttention(window))
    args = fias_args(step, 128)
    kwargs = args.attention_kwargs(window)
    assert (kwargs["sparse_mode"], kwargs["pre_tokens"], kwargs["next_tokens"]) == (4, window - 1, 0)
    blocks = step.k_after.shape[0]
    out = npu_args.fused_infer_attention_reference(
        step.q, step.k_after.view(blocks, 128, -1), step.v_after.view(blocks, 128, -1), **kwargs
    )
    torch.testing.assert_close(out, step.out, **TOLERANCE)


def test_a_soft_capped_model_is_refused_on_the_npu_backend_only():
    capped = (PATTERNS["softcap4"], PATTERNS["window3"])
    with pytest.raises(
        ValueError, match="'npu' cannot soft-cap attention scores.*softcap 4.0.*cpu or cpu-native or cuda"
    ):
        registry.require_attention("npu", capped)
    for backend in registry.SOFTCAP:
        registry.require_attention(backend, capped)
    registry.require_attention("npu", (PATTERNS["window3"],))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_npu_cache_write_lands_where_the_cpu_backend_writes(scenario):
    step = make_step(*SCENARIOS[scenario], block_size=128)
    args = fias_args(step, 128)
    k_pool, v_pool = step.k_before.clone(), step.v_before.clone()
    npu_args.reshape_and_cache_reference(step.k, step.v, k_pool, v_pool, args.slot_mapping)
    assert torch.equal(k_pool, step.k_after) and torch.equal(v_pool, step.v_after)


def test_the_npu_arguments_follow_the_ops_conventions():
    step = make_step([1, 6, 3, 1], [200, 0, 130, 2], block_size=128)
    args = fias_args(step, 128)
    kwargs = args.attention_kwargs()
    assert kwargs["input_layout"] == "TND" and kwargs["sparse_mode"] == 3
    assert kwargs["actual_seq_lengths"] == [1, 7, 10, 11], "cumulative query ends (TND)"
    assert kwargs["actual_seq_lengths_kv"] == [201, 6, 133, 3], "keys per sequence, not cumulative"
    assert kwargs["block_table"].dtype == torch.int32 and kwargs["block_table"].shape == (4, 2)
    assert kwargs["block_table"].min() >= 0, "padding is a valid block id"
    assert kwargs["atten_mask"].shape == (2048, 2048) and kwargs["atten_mask"].dtype == torch.bool
    assert kwargs["atten_mask"][0, 1] and not kwargs["atten_mask"][1, 0], "True above the diagonal"
    assert (kwargs["num_heads"], kwargs["num_key_value_heads"], kwargs["block_size"]) == (
        HEADS,
        KV_HEADS,
        128,
    )
    assert args.slot_mapping.dtype == torch.int32


def test_the_npu_reference_is_sensitive_to_the_lengths_convention():
    """A builder passing per-sequence query lengths (or cumulative key lengths) gets other numbers."""
    step = make_step([4, 7, 3], [6, 13, 1], block_size=128)
    args = fias_args(step, 128)
    blocks = step.k_after.shape[0]
    kv = step.k_after.view(blocks, 128, -1), step.v_after.view(blocks, 128, -1)
    kwargs = args.attention_kwargs()
    with pytest.raises(ValueError):
        npu_args.fused_infer_attention_reference(step.q, *kv, **{**kwargs, "actual_seq_lengths": [4, 7, 3]})
    cumulative_kv = {**kwargs, "actual_seq_lengths_kv": [10, 30, 34]}
    wrong = npu_args.fused_infer_attention_reference(step.q, *kv, **cumulative_kv)
    assert not torch.allclose(wrong, step.out, atol=1e-3)


def test_the_npu_block_size_is_refused_unless_the_op_pages_by_it():
    step = make_step([4, 1], [0, 3], block_size=16)
    with pytest.raises(ValueError, match="multiple of 128 tokens, the pool's are 16: .*--block-size 128"):
        fias_args(step, 16)
    npu_args.require_block_size(16, prefill=False)
    with pytest.raises(ValueError, match="multiple of 16 tokens, the pool's are 8"):
        npu_args.require_block_size(8, prefill=False)


def auto(device: str, dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> str:
    flags = planning.Flags(dtype, device=device, attention_backend=backend)
    return planning.attention_backend(flags, planning.this_machine()).implementation


def test_auto_picks_the_devices_backend():
    assert [auto(device) for device in ("cpu", "cuda", "cuda:1")] == ["cpu", "cuda", "cuda"]
    assert auto("cpu", torch.float32) == ("cpu-native" if kernels.load() else "cpu")
    assert auto("cpu", backend="cuda") == "cuda", "its torch path checks it on the cpu"


@pytest.mark.parametrize(
    ("backend", "device", "message"),
    [
        ("npu", "cpu", "'npu' runs on npu, not on cpu"),
        ("cpu", "cuda", "'cpu' runs on cpu, not on cuda"),
        ("cuda", "npu", "'cuda' runs on cuda or cpu, not on npu"),
        ("rocm", "cpu", "unknown attention backend 'rocm'"),
    ],
)
def test_a_backend_on_a_device_it_cannot_run_on_is_refused(backend, device, message):
    with pytest.raises(ValueError, match=message):
        registry.check_backend(backend, device)


def test_the_npu_backend_without_torch_npu_is_refused_only_when_selected(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(ValueError, match=r"needs torch_npu .*pip install -e '.\[npu\]'"):
        auto("npu")
    assert auto("cpu") == "cpu"


@pytest.mark.parametrize(
    ("backend", "kv_dtype"),
    [("npu", "float32"), ("npu", "fp8_e4m3"), ("cuda", "fp8_e5m2"), ("cuda", "fp8_e4m3")],
)
def test_a_kv_dtype_a_device_backend_cannot_store_is_refused(backend, kv_dtype):
    with pytest.raises(ValueError, match=f"'{backend}' cannot store K/V as {kv_dtype}; choose"):
        registry.require_kv_dtype(backend, kv_dtype)


def test_each_kv_groups_device_arguments_reproduce_the_cpu_backend():
    # a full layer (group 0) and a 7-token sliding one (group 1) over one layer slot, distinct blocks each
    new, cached = SCENARIOS["mixed"]
    gen = torch.Generator().manual_seed(3)
    order = torch.randperm(2 * len(new), generator=gen).tolist()
    tables = [[[block] for block in order[: len(new)]], [[block] for block in order[len(new) :]]]
    request = forward_request([[0] * n for n in new], cached, tables[0], block_size=128)
    request.block_tables.extend(
        forward_request([[0] * n for n in new], cached, tables[1], block_size=128).block_tables
    )
    request.num_kv_groups = 2
    limits = Limits(vocab_size=1, max_model_len=4096, num_blocks=len(order), block_size=128, num_groups=2)
    groups = ForwardBatch.from_request(request, limits).by_group()
    shape = (len(order), 128, KV_HEADS, HEAD_DIM)
    k_pool, v_pool = (torch.randn(shape, generator=gen) for _ in range(2))
    outs = []
    for batch, attends in zip(groups, (FULL, LayerAttention(7)), strict=True):
        q = torch.randn(sum(new), HEADS, HEAD_DIM, generator=gen)
        k, v = (torch.randn(sum(new), KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
        out = run_backend(cpu.paged_attention, q, k, v, batch, k_pool, v_pool, attends)
        flat = k_pool.view(-1, KV_HEADS, HEAD_DIM)
        assert torch.equal(flat[batch.slot_mapping], k), "the group's new K/V land in its own blocks"
        args = cuda_args.build_varlen_args(
            batch.cu_seqlens_q, batch.context_lens, batch.block_tables, batch.slot_mapping
        )
        window = cuda_args.flash_window(attends.window)
        torch.testing.assert_close(
            cuda_args.paged_varlen_attention(q, k_pool, v_pool, args, SCALE, window), out, **TOLERANCE
        )
        fias = npu_args.build_fias_args(
            batch.cu_seqlens_q,
            batch.context_lens,
            batch.block_tables,
            batch.slot_mapping,
            (HEADS, KV_HEADS),
            128,
            SCALE,
        )
        views = (pool.view(len(order), 128, -1) for pool in (k_pool, v_pool))
        kwargs = fias.attention_kwargs(attends.window)
        torch.testing.assert_close(
            npu_args.fused_infer_attention_reference(q, *views, **kwargs), out, **TOLERANCE
        )
        outs.append(out)
    assert not torch.equal(groups[0].block_tables, groups[1].block_tables)
    assert not torch.allclose(outs[0], outs[1]), "each layer read its own group's blocks"
