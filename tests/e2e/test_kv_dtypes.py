"""--kv-dtype end to end on `pagedserve up` stacks of a tiny random-weight model: each KV dtype serves,
blocks scale with the dtype's size in the same --kv-memory, GetInfo/stats/metrics name the dtype, and a pool
of another dtype or other fp8 scales is refused."""

import urllib.request

import grpc
import pytest

from cli.launch import Stack
from compute_service import planning
from protos import cache_pb2, compute_pb2
from tests.e2e.stack import stacks_side_by_side
from tests.tiny_model import tiny_llama_config

pytestmark = pytest.mark.e2e

KV_DTYPES = ("float16", "fp8_e4m3", "fp8_e5m2")
KV_MEMORY = 2**20
PROMPT = [5, 17, 200, 33, 9, 61, 140, 7, 88, 3, 250, 19, 44, 100, 2, 71, 12, 90]
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stacks(tiny_model, logs):
    flags = ("--model", str(tiny_model), "--dtype", "float32", "--kv-memory", str(KV_MEMORY))
    with stacks_side_by_side(logs, flags, "--kv-dtype", KV_DTYPES) as started:
        yield started


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_each_kv_dtype_serves_and_a_prefix_hit_gives_the_same_tokens(stacks, kv_dtype):
    stack = stacks[kv_dtype]
    with stack.client() as client:
        first = client.generate(token_ids=PROMPT, **GREEDY)
        hits = stack.stats().prefix_hit_tokens
        again = client.generate(token_ids=PROMPT, **GREEDY)
    assert len(first.token_ids) == 8 and first.finish_reason == "length"
    assert stack.stats().prefix_hit_tokens > hits, "the second request reads the first one's K/V"
    # NOTE: a fresh prompt attends over its K/V as the pool holds them, so a cached prefix changes nothing.
    assert again.token_ids == first.token_ids


def test_blocks_scale_with_the_kv_dtype_in_the_same_memory(stacks):
    config = tiny_llama_config()
    layers, heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    float32_blocks = KV_MEMORY // (layers * 2 * 16 * heads * head_dim * 4)
    with stacks["float16"].client() as client:
        assert client.info().num_blocks == 2 * float32_blocks
    for name in ("fp8_e4m3", "fp8_e5m2"):
        with stacks[name].client() as client:
            assert client.info().num_blocks == 4 * float32_blocks


def test_info_stats_and_metrics_name_the_kv_dtype(stacks):
    backend = planning.attention_backend(planning.Flags(), planning.this_machine()).implementation
    stack = stacks["fp8_e4m3"]
    with stack.client() as client:
        info = client.info()
    assert (info.dtype, info.kv_dtype, info.device, info.attention_backend) == (
        "float32",
        "fp8_e4m3",
        "cpu",
        backend,
    )
    stats = stack.stats()
    assert (stats.kv_dtype, stats.device) == ("fp8_e4m3", "cpu")
    cache = urllib.request.urlopen(stack.metrics_url("cache"), timeout=10).read().decode()
    assert 'pagedserve_kv_pool_info{device="cpu",kv_dtype="fp8_e4m3"} 1.0' in cache
    compute = urllib.request.urlopen(stack.metrics_url("compute"), timeout=10).read().decode()
    line = next(line for line in compute.splitlines() if line.startswith("pagedserve_compute_info{"))
    assert (
        'kv_dtype="fp8_e4m3"' in line
        and 'dtype="float32"' in line
        and f'attention_backend="{backend}"' in line
    )


def model_info(stack: Stack) -> compute_pb2.ModelInfo:
    return stack.compute().GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10)


def handle_of(stack: Stack, kv_scales_id: str):
    """CreatePool of the stack's own layout with these scales: its live pool's handle when they match."""
    info = model_info(stack)
    geometry = cache_pb2.PoolGeometry(
        num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim
    )
    request = cache_pb2.CreatePoolRequest(
        geometry=geometry, block_size=16, kv_dtype=info.kv_dtype, model=info.model, kv_scales_id=kv_scales_id
    )
    return stack.cache().CreatePool(request, timeout=10)


def test_compute_refuses_a_pool_of_another_dtype_or_other_scales(stacks):
    e4m3, e5m2 = stacks["fp8_e4m3"], stacks["fp8_e5m2"]
    info = model_info(e4m3)
    handle = handle_of(e4m3, info.kv_scales_id)
    assert handle.dtype == "fp8_e4m3" and handle.kv_scales_id == info.kv_scales_id != ""
    with pytest.raises(grpc.RpcError) as err:
        e5m2.compute().AttachPool(handle, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "KV dtype fp8_e5m2, got" in err.value.details() and "fp8_e4m3" in err.value.details()
    handle.kv_scales_id = "0123456789abcdef"
    with pytest.raises(grpc.RpcError) as err:
        e4m3.compute().AttachPool(handle, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stored with other scales (kv_scales_id '0123456789abcdef')" in err.value.details()
    # the cache keeps its pool's scales: another identity is another layout
    with pytest.raises(grpc.RpcError) as err:
        handle_of(e4m3, "0123456789abcdef")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kv scales 0123456789abcdef" in err.value.details()
    # both stacks still serve on their own pools
    for stack in (e4m3, e5m2):
        with stack.client() as client:
            assert len(client.generate(token_ids=PROMPT, **GREEDY).token_ids) == 8
