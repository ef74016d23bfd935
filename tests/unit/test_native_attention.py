"""The native paged-attention kernel against the dense reference: random block tables, context lengths at
and around block boundaries, GQA, every pool dtype, decodes and prompt chunks over a cached prefix, shared
blocks; and its refusals."""

import os
import subprocess
import sys
import time

import pytest
import torch

from common import paging
from compute_service import kernels, model_loader, planning
from compute_service.attention import cpu_native
from compute_service.attention.reference import reference_attention
from tests.paged_pools import NUM_BLOCKS, pool, tables


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def attend(
    q, k_cache, v_cache, q_lens, context_lens, table, scale, kv_scales=(1.0, 1.0), window=0, softcap=0.0
):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    cpu_native.kernel().paged_attention(
        q, out, k_cache, v_cache, table, starts[:-1], torch.tensor(q_lens), torch.tensor(context_lens), scale,
        *kv_scales, window, softcap,
    )  # fmt: skip
    return out, starts


def check(q_lens, context_lens, block_size=16, heads=9, kv_heads=3, head_dim=64, kv_dtype=torch.float32,
          q_dtype=torch.float32, shared=0, kv_scales=(1.0, 1.0), window=0, softcap=0.0):  # fmt: skip
    k_cache, v_cache = pool(block_size, kv_heads, head_dim, kv_dtype, kv_scales[0])
    table = tables(context_lens, block_size, shared)
    q = torch.randn(sum(q_lens), heads, head_dim).to(q_dtype)
    scale = head_dim**-0.5
    out, starts = attend(q, k_cache, v_cache, q_lens, context_lens, table, scale, kv_scales, window, softcap)
    keys, values = k_cache.float() * kv_scales[0], v_cache.float() * kv_scales[1]
    expected = reference_attention(
        q, keys, values, starts, torch.tensor(context_lens), table, scale, window, softcap
    )
    exact = q_dtype == torch.float32
    torch.testing.assert_close(out, expected, **(dict(atol=2e-5, rtol=1e-4) if exact else {}))


@pytest.mark.parametrize("context_len", [1, 15, 16, 17, 32, 33, 560, 1500])
def test_decode_at_and_around_block_boundaries(context_len):
    check([1, 1], [context_len, max(1, context_len - 7)])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 8), (8, 1, 16), (6, 2, 128)])
def test_gqa_groups_and_head_dims(heads, kv_heads, head_dim):
    check([1, 1, 1], [40, 3, 77], heads=heads, kv_heads=kv_heads, head_dim=head_dim)


@pytest.mark.parametrize("block_size", [1, 4, 5, 16, 32])
def test_block_sizes(block_size):
    check([1, 6, 1], [50, 20, 1], block_size=block_size)


def test_prompt_chunks_over_a_cached_prefix_are_causal():
    check([13, 1, 8, 17, 3], [45, 600, 8, 17, 300])


def test_prompt_chunks_longer_than_a_work_item():
    # a chunk is attended in items of up to 32 queries: 70 is three of them, 64 two, 33 two
    check([70, 64, 33, 5], [200, 600, 33, 21])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (14, 2, 64), (4, 4, 64), (8, 1, 128), (6, 2, 32), (6, 3, 8)],
)
@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_prompt_chunks_of_every_gqa_group_head_dim_and_block_size(heads, kv_heads, head_dim, block_size):
    """Prompt chunks of whole vectors of query rows go through the register-tiled products (float32, head dims
    of whole vectors): chunks of 2 to 70 queries (rows around a vector's 8 or 16 lanes), fresh and over a
    cached prefix, contexts ending inside and at the 32-key rounds, beside a decode."""
    check([2, 5, 6, 16, 70, 33, 1], [2, 150, 38, 16, 70, 97, 20], block_size=block_size, heads=heads,
          kv_heads=kv_heads, head_dim=head_dim)  # fmt: skip


def test_prompt_queries_read_from_a_fused_product():
    """Prompt queries as a step passes them: a view into the fused QKV product, rows a whole QKV row apart."""
    k_cache, v_cache = pool(16, 3, 64, torch.float32)
    q_lens, context_lens = [40, 20], [40, 560]
    table = tables(context_lens, 16)
    qkv = torch.randn(sum(q_lens), (9 + 2 * 3) * 64)
    q = qkv[:, : 9 * 64].view(-1, 9, 64)
    assert q.stride(0) == qkv.shape[1]
    out, starts = attend(q, k_cache, v_cache, q_lens, context_lens, table, 0.125)
    expected = reference_attention(q, k_cache, v_cache, starts, torch.tensor(context_lens), table, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 7, 16, 17, 40])
@pytest.mark.parametrize(
    ("block_size", "kv_dtype"), [(16, torch.float32), (16, torch.bfloat16), (5, torch.float32)]
)
def test_sliding_windows_over_decodes_and_chunks(window, block_size, kv_dtype):
    """Windows inside a block, of a block, across blocks; decodes and chunks (their earliest query's window
    starting inside a block), contexts shorter than the window; the float keys of 64 in blocks of 16 scored
    by the 16-float vectors on AVX-512, bfloat16 ones of a 13-query chunk through the transposed keys."""
    check(
        [1, 1, 13, 1, 40, 3], [300, 5, 61, 33, 80, 3], block_size=block_size, kv_dtype=kv_dtype, window=window
    )


@pytest.mark.parametrize(("window", "softcap"), [(0, 5.0), (0, 50.0), (9, 2.0)])
def test_soft_capped_scores(window, softcap):
    check([1, 6, 1, 35], [70, 20, 1, 35], window=window, softcap=softcap)
    check([1, 4], [50, 9], block_size=4, head_dim=16, heads=4, kv_heads=2, window=window, softcap=softcap)


def test_decodes_sharing_prefix_blocks_under_a_window_read_their_own_last_keys():
    lens = [512 + 16 * i + 3 for i in range(8)]
    check([1] * 8, lens, shared=32, window=20)


def test_decodes_sharing_prefix_blocks():
    lens = [512 + 16 * i + 3 for i in range(8)]
    check([1] * 8, lens, shared=32)


def _unshared(k_cache, v_cache, table: torch.Tensor):
    """The same keys and values with every sequence's blocks its own: shared blocks copied apart."""
    used = table[table >= 0]
    assert used.numel() <= NUM_BLOCKS, "room to copy every entry"
    spread = torch.full_like(table, -1)
    spread[table >= 0] = torch.arange(used.numel())
    return k_cache[used].clone(), v_cache[used].clone(), spread


# each decode: (context length, the shared prefix its table starts with: "a" 10 blocks, "b" 6, or none)
STEP = [(41, "a"), (40, "a"), (13, None), (90, "a"), (39, "a"), (64, "b"), (25, "b"), (44, "a"), (44, "a"),
        (60, "a"), (24, "b"), (47, "a"), (70, "a"), (41, "a"), (43, "a"), (33, None)]  # fmt: skip


def shared_tables(context_lens: list[int], prefixes: list[str | None], block_size: int) -> torch.Tensor:
    order = torch.randperm(NUM_BLOCKS).tolist()
    shared, free = {"a": order[:10], "b": order[10:16]}, iter(order[16:])
    rows = []
    for context_len, prefix in zip(context_lens, prefixes, strict=True):
        need = paging.blocks_for(context_len, block_size)
        blocks = shared[prefix][:need] if prefix else []
        rows.append(blocks + [next(free) for _ in range(need - len(blocks))])
    width = max(map(len, rows))
    return torch.tensor([row + [-1] * (width - len(row)) for row in rows])


@pytest.mark.parametrize(
    ("block_size", "kv_dtype"),
    [(4, torch.float32), (4, torch.bfloat16), (16, torch.float32), (16, torch.bfloat16)],
)
def test_decodes_sharing_leading_blocks_get_what_reading_them_apart_gives(block_size, kv_dtype):
    """Decodes whose tables start with the same blocks are attended in groups (each shared block read once
    for the group): more sharers than a group holds, two prefixes, contexts ending inside, at and past the
    shared blocks, a prompt chunk beside them. Blocks of 4: exactly the output of the same keys in blocks of
    their own; blocks of 16 (float32 keys scored by scores64 on AVX-512, else, as bfloat16 ones are, through
    the group's keys transposed): that output up to float rounding."""
    k_cache, v_cache = pool(block_size, 3, 64, kv_dtype)
    q_lens = [1] * len(STEP) + [5]
    context_lens = [c * block_size // 4 for c, _ in STEP] + [30 * block_size // 4]
    table = shared_tables(context_lens, [p for _, p in STEP] + [None], block_size)
    q = torch.randn(sum(q_lens), 9, 64)
    grouped, starts = attend(q, k_cache, v_cache, q_lens, context_lens, table, 0.125)
    k_apart, v_apart, table_apart = _unshared(k_cache, v_cache, table)
    apart, _ = attend(q, k_apart, v_apart, q_lens, context_lens, table_apart, 0.125)
    if block_size == 4:
        assert torch.equal(grouped, apart)
    torch.testing.assert_close(grouped, apart, atol=2e-5, rtol=1e-4)
    keys, values, lens = k_cache.float(), v_cache.float(), torch.tensor(context_lens)
    expected = reference_attention(q, keys, values, starts, lens, table, 0.125)
    torch.testing.assert_close(grouped, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_pool_and_query_dtypes(kv_dtype, q_dtype):
    check([1, 5, 1], [70, 30, 129], kv_dtype=kv_dtype, q_dtype=q_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pools_with_layer_scales(kv_dtype):
    check([1, 4, 1], [90, 20, 33], kv_dtype=kv_dtype, kv_scales=(0.05, 0.2))


def test_queries_strided_in_the_head_dim():
    """A query view strided in the head dim (a transposed product's layout) is read as it is."""
    k_cache, v_cache = pool(16, 3, 64, torch.float32)
    table = tables([40, 17, 5], 16)
    q = torch.randn(9 * 64, 3).t().view(3, 9, 64)
    assert q.stride(2) != 1
    out, starts = attend(q, k_cache, v_cache, [1, 1, 1], [40, 17, 5], table, 0.125)
    expected = reference_attention(q, k_cache, v_cache, starts, torch.tensor([40, 17, 5]), table, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_writes_only_the_rows_of_its_sequences():
    k_cache, v_cache = pool(16, 3, 64, torch.float32)
    q = torch.randn(10, 9, 64)
    out = torch.full_like(q, float("nan"))
    table = tables([20, 30], 16)
    # rows 0-3 and 6-9 belong to other sequences (fresh prompts attended elsewhere)
    cpu_native.kernel().paged_attention(
        q, out, k_cache, v_cache, table, torch.tensor([4, 5]), torch.tensor([1, 1]), torch.tensor([20, 30]),
        0.125, 1.0, 1.0, 0, 0.0,
    )  # fmt: skip
    assert out[4:6].isfinite().all()
    assert out[:4].isnan().all() and out[6:].isnan().all()


def test_the_kernels_run_on_torchs_threads_with_the_same_result(torch_threads):
    # the build has OpenMP (without it at::parallel_for runs every loop on the calling thread)
    k_cache, v_cache = pool(16, 3, 64, torch.float32)
    table = tables([300, 17, 5, 64], 16, shared=1)
    q = torch.randn(4, 9, 64)
    outputs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert cpu_native.kernel().parallel_threads() == threads
        outputs.append(attend(q, k_cache, v_cache, [1, 1, 1, 1], [300, 17, 5, 64], table, 0.125)[0])
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)


def test_refuses_a_block_outside_the_pool():
    k_cache, v_cache = pool(16, 3, 64, torch.float32)
    table = torch.tensor([[3, NUM_BLOCKS]])
    with pytest.raises(RuntimeError, match="outside the pool"):
        attend(torch.randn(1, 9, 64), k_cache, v_cache, [1], [20], table, 0.125)


def test_refuses_mismatched_geometry():
    k_cache, v_cache = pool(16, 3, 64, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        attend(torch.randn(1, 8, 64), k_cache, v_cache, [1], [5], torch.tensor([[0]]), 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        attend(torch.randn(1, 9, 64), k_cache, v_cache, [1], [5], torch.tensor([[0]], dtype=torch.int32), 0.1)


def test_a_machine_that_cannot_build_falls_back_to_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")  # the compiler fails
    kernels.load.cache_clear()
    try:
        assert kernels.load() is None
        assert auto_backend() == "cpu"
        with pytest.raises(ValueError, match="cpu-native: its kernel cannot be built"):
            model_loader.load("unused", torch.float32, "cpu-native")
        with pytest.raises(RuntimeError, match="--attention-backend cpu"):
            cpu_native.kernel()
    finally:
        monkeypatch.undo()
        kernels.load.cache_clear()
    assert auto_backend() == "cpu-native", "this machine builds it"


def test_a_build_is_loaded_past_a_killed_builds_lock_file():
    """A compute killed while torch's extension loader held the build directory's lock used to leave every
    later start waiting on it forever; a finished build is now imported without taking the lock."""
    assert kernels.load() is not None
    lock = kernels.build_dir() / "lock"
    lock.touch()
    try:
        loaded = subprocess.run(
            [sys.executable, "-c", "from compute_service import kernels; assert kernels.load()"],
            timeout=120,
            capture_output=True,
        )
        assert loaded.returncode == 0, loaded.stderr.decode()[-500:]
    finally:
        lock.unlink(missing_ok=True)


def test_a_stale_lock_is_removed_before_a_build_and_a_fresh_one_kept(tmp_path):
    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    stale.touch()
    fresh.touch()
    old = time.time() - kernels.STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    kernels._remove_stale_lock(stale)
    kernels._remove_stale_lock(fresh)
    kernels._remove_stale_lock(tmp_path / "absent")
    assert not stale.exists() and fresh.exists()


def test_bfloat16_weights_default_to_the_cpu_backend():
    assert auto_backend(torch.float32) == "cpu-native"
    assert auto_backend(torch.bfloat16) == "cpu"


def auto_backend(dtype: torch.dtype = torch.float32) -> str:
    """--attention-backend auto's choice on this machine, as the execution plan makes it."""
    return planning.attention_backend(planning.Flags(dtype), planning.this_machine()).implementation
