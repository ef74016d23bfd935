"""--tensor-parallel-size's start-up checks (compute_service.tensor_parallel): what the ranks cannot split is
refused in one line naming what is served, before any weight loads; the flags a rank loads with."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from cache_service.kv_pool import KVPool, pool_groups, shard_ranks, spec_from_request
from common.devices import CPU
from common.errors import InvalidArgument
from common.kv_groups import group_size
from common.options import REFUSED
from common.sparse_settings import parse
from compute_service import kv_pool, planning, tensor_parallel
from compute_service.planning import Flags
from compute_service.server import ComputeServicer
from protos import cache_pb2, common_pb2
from tests.architectures import save_tiny, tiny_config
from tests.helpers import ROOT
from tests.sharded_forward import PROMPT
from tests.tiny_model import tiny_llama_config

SERVED = (
    "--tensor-parallel-size serves llama, mistral, qwen2, qwen3, gemma2, gemma3_text, mixtral, qwen2_moe, "
    "qwen3_moe, olmoe models"
)
MIXTURES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def _config(name: str, **changes):
    config = tiny_config(name)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("name", ["gemma2", "qwen3", "mistral", *MIXTURES])
def test_split_architectures_pass_and_plan(name):
    config = tiny_config(name)
    tensor_parallel.check(config, 2)
    flags = tensor_parallel.flags(Flags())
    tensor_parallel.check_flags(flags, 2)
    assert planning.resolve(config, flags, planning.this_machine()).layers.implementation == "transformers"


def test_a_rank_loads_transformers_layers_on_plain_linears():
    flags = tensor_parallel.flags(Flags())
    assert (flags.fused, flags.plain_linear) == (False, True)


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        (tiny_config("phi3"), "a phi3 model is not sharded"),
        (tiny_llama_config(num_key_value_heads=1), "the model's KV heads (1) do not split over 2 ranks"),
        (tiny_llama_config(intermediate_size=129), "MLP columns (intermediate_size) (129) do not split"),
        (
            _config("qwen2_moe", moe_intermediate_size=33),
            "MLP columns (moe_intermediate_size) (33) do not split",
        ),
        (
            _config("qwen2_moe", shared_expert_intermediate_size=65),
            "MLP columns (shared_expert_intermediate_size) (65) do not split",
        ),
    ],
)
def test_a_model_the_ranks_cannot_split_is_refused_in_one_line(config, refusal):
    with pytest.raises(ValueError) as refused:
        tensor_parallel.check(config, 2)
    message = str(refused.value)
    assert refusal in message and SERVED in message and "\n" not in message


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (Flags(device="cuda:0"), "on cuda:0: the ranks run on the cpu (gloo)"),
        (Flags(weights="int8"), "--weights int8: "),
        (Flags(kv_dtype=torch.bfloat16), "--kv-dtype bfloat16: "),
        (Flags(sparse_attention=parse("on")), "--sparse-attention: "),
    ],
)
def test_flags_the_ranks_cannot_split_under_are_refused_in_one_line(flags, refusal):
    with pytest.raises(ValueError) as refused:
        tensor_parallel.check_flags(flags, 2)
    message = str(refused.value)
    assert refusal in message and SERVED in message and "\n" not in message


def test_two_ranks_of_split_experts_give_the_whole_models_logits(tmp_path):
    """Each mixture's experts (and Qwen2-MoE's shared expert) split over two gloo ranks: every layer's parts
    summed by its all-reduce give the unsplit model's logits on both ranks."""
    paths = [str(save_tiny(name, tmp_path / name)) for name in MIXTURES]
    out, init = tmp_path / "logits", tmp_path / "rendezvous"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.sharded_forward", str(rank), "2", str(init), str(out), *paths],
            cwd=ROOT,
        )  # fmt: skip
        for rank in range(2)
    ]
    assert [rank.wait(timeout=300) for rank in ranks] == [0, 0]
    results = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for name, path in zip(MIXTURES, paths, strict=True):
        whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            expected = whole.eval()(torch.tensor([PROMPT])).logits[0]
        for rank, result in enumerate(results):
            logits, split = result[path]
            assert split == whole.config.num_hidden_layers, f"{name}: every layer's experts were split"
            where = f"{name}, rank {rank}"
            torch.testing.assert_close(
                logits, expected, rtol=1e-5, atol=1e-4, msg=lambda error, where=where: f"{where}: {error}"
            )


def test_one_rank_serves_anything_served():
    tensor_parallel.check(tiny_config("phi3"), 1)
    tensor_parallel.check_flags(Flags(weights="int8"), 1)


def test_the_cache_keeps_one_pool_per_rank_that_each_rank_maps_alone():
    """A CreatePool of 2 ranks: one segment of two pools rank-major in the layer slots, each of one rank's
    KV heads; the handle carries the ranks, and a handle with shard_rank r maps rank r's pool only."""
    request = cache_pb2.CreatePoolRequest(
        geometry=cache_pb2.PoolGeometry(num_layers=3, num_kv_heads=1, head_dim=8),
        block_size=4,
        kv_dtype="float32",
        num_blocks=5,
        shard_ranks=2,
    )
    groups = pool_groups(request)
    spec = spec_from_request(request, 0, 0, group_size(groups) * shard_ranks(request))
    pool = KVPool.create(spec, "tiny", "freelist", True, groups=groups, ranks=2)
    try:
        assert list(pool.handle.shape) == [6, 2, 5, 4, 1, 8] and pool.handle.shard_ranks == 2
        ranks = []
        for rank in range(2):
            handle = common_pb2.PoolHandle()
            handle.CopyFrom(pool.handle)
            handle.shard_rank = rank
            ranks.append(kv_pool.map_kv_pool(handle, CPU))
        assert [list(mine.shape) for mine in ranks] == [[3, 2, 5, 4, 1, 8]] * 2
        assert ranks[1].is_contiguous(), "a rank's pool is contiguous"
        pool.tensor[3:, :, 2].fill_(7.0)
        assert ranks[1][:, :, 2].eq(7.0).all() and not ranks[0].any(), "rank 1's slots only"
    finally:
        pool.release()


def test_a_shard_ranks_below_zero_is_refused():
    with pytest.raises(InvalidArgument, match="shard_ranks must be >= 0, got -1"):
        shard_ranks(cache_pb2.CreatePoolRequest(shard_ranks=-1))


def test_compute_refuses_a_pool_of_another_rank_count():
    request = cache_pb2.CreatePoolRequest(
        geometry=cache_pb2.PoolGeometry(num_layers=2, num_kv_heads=2, head_dim=8),
        block_size=4,
        kv_dtype="float32",
        num_blocks=3,
    )
    pool = KVPool.create(spec_from_request(request, 0, 0), "tiny", "freelist", True)
    spec = SimpleNamespace(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        kv_dtype_name="float32",
        sliding_windows=(0, 0),
        tensor_parallel_size=2,
    )
    servicer = ComputeServicer(SimpleNamespace(group=None), spec, SimpleNamespace())
    try:
        with pytest.raises(InvalidArgument, match="the pool holds 1 tensor-parallel ranks' pools"):
            servicer.AttachPool(pool.handle, None)
    finally:
        pool.release()


def test_adapters_over_ranks_are_refused_at_start_in_one_line(tmp_path):
    path = save_tiny("qwen2", tmp_path / "qwen2")
    command = [sys.executable, "-m", "compute_service", "--model", str(path), "--enable-lora"]
    command += ["--socket", str(tmp_path / "compute.sock"), "--tensor-parallel-size", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == REFUSED
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("compute_service:")]
    assert "with LoRA adapters" in line and SERVED in line
    assert "shard_rank" not in done.stderr, "refused before any rank starts"
