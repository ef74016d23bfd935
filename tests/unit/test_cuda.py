"""The CUDA device for real: the cuda attention backend's kernel on the GPU against the cpu backend, the
pool shared with another process by CUDA IPC, and greedy generation on the GPU equal to transformers'.
Marked `cuda` and skipped, with the reason printed (-rs), where torch sees no CUDA device; the same logic
is checked on the CPU by tests/unit/test_device_backends.py and test_device_pools.py."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from cache_service.kv_pool import KVPool
from common.devices import Device
from common.shared_pool import PoolSpec
from compute_service.architectures import FULL
from compute_service.attention import cuda
from compute_service.batch import ForwardBatch
from compute_service.model_loader import register_attention
from compute_service.runner import Runner
from compute_service.validation import Limits
from tests.device_steps import PATTERNS, SCENARIOS, make_step, run_backend
from tests.forward import forward_request
from tests.helpers import ROOT
from tests.tiny_model import tiny_llama_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is false here"
    ),
]
GPU = Device("cuda", 0)


@pytest.mark.parametrize("pattern", ["full", *PATTERNS])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size", [16, 256])
def test_the_cuda_kernel_matches_the_cpu_backend(scenario, block_size, pattern):
    """Pages of 256 tokens take flash_attn where it is installed (with the layer's window_size and softcap);
    16 takes the torch path."""
    attends = PATTERNS.get(pattern, FULL)
    step = make_step(*SCENARIOS[scenario], block_size=block_size, dtype=torch.bfloat16, attends=attends)
    on_gpu = [t.to("cuda") for t in (step.q, step.k, step.v, step.k_before, step.v_before)]
    k_pool, v_pool = on_gpu[3].clone(), on_gpu[4].clone()
    out = run_backend(cuda.paged_attention, *on_gpu[:3], step.batch, k_pool, v_pool, attends)
    assert torch.equal(k_pool.cpu(), step.k_after) and torch.equal(v_pool.cpu(), step.v_after)
    torch.testing.assert_close(out.cpu(), step.out, atol=2e-2, rtol=2e-2)


OTHER_PROCESS = """
import sys
import torch
from common.devices import Device
from compute_service import kv_pool
from protos import common_pb2
handle = common_pb2.PoolHandle.FromString(open(sys.argv[1], "rb").read())
pool = kv_pool.map_kv_pool(handle, Device("cuda", 0))
assert pool[1, 0, 2].eq(3).all(), "sees the owner's write"
pool[0, 1, 1].fill_(7)
torch.cuda.synchronize()
"""


def test_the_pool_is_shared_with_another_process_by_cuda_ipc(tmp_path):
    spec = PoolSpec(2, 4, 16, 2, 64, torch.bfloat16)
    kv = KVPool.create(spec, "tiny", "freelist", True, device=GPU)
    try:
        assert kv.tensor.is_cuda and kv.handle.cuda.uuid
        kv.tensor[1, 0, 2].fill_(3)
        torch.cuda.synchronize()
        (tmp_path / "handle").write_bytes(kv.handle.SerializeToString())
        env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [sys.executable, "-c", OTHER_PROCESS, str(tmp_path / "handle")], env=env, timeout=120, check=False
        )
        assert done.returncode == 0
        assert kv.tensor[0, 1, 1].eq(7).all(), "the owner sees the other process's write"
    finally:
        kv.release()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_generation_on_the_gpu_equals_transformers(dtype):
    torch.manual_seed(0)
    config = tiny_llama_config(initializer_range=0.3)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    paged = AutoModelForCausalLM.from_config(
        config, attn_implementation=register_attention("cuda"), dtype=dtype
    )
    paged.load_state_dict(reference.state_dict())
    reference, paged = reference.to("cuda"), paged.eval().to("cuda")
    prompts, steps, block_size, num_blocks = (
        [[5, 6, 7, 8, 9], [100, 3, 44, 55, 66, 77, 88], [10, 20]],
        6,
        16,
        8,
    )
    runner = Runner(paged)
    shape = (config.num_hidden_layers, 2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    runner.attach(torch.zeros(shape, dtype=dtype, device="cuda"))
    tables = [[i * 2, i * 2 + 1] for i in range(len(prompts))]
    limits = Limits(config.vocab_size, config.max_position_embeddings, num_blocks, block_size)
    generated, new, cached = [[] for _ in prompts], prompts, [0] * len(prompts)
    for _ in range(steps):
        request = forward_request(new, cached, tables, block_size=block_size)
        tokens = runner.forward(ForwardBatch.from_request(request, limits)).tokens.tolist()
        for seq, token in enumerate(tokens):
            generated[seq].append(token)
        cached = [c + len(n) for c, n in zip(cached, new, strict=True)]
        new = [[token] for token in tokens]
    for seq, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device="cuda")
        expected = reference.generate(ids, max_new_tokens=steps, do_sample=False)[0, len(prompt) :]
        assert generated[seq] == expected.tolist(), f"sequence {seq} in {dtype}"
