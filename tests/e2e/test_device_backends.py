"""Device backends end to end on this CPU host: a `pagedserve up` stack running the cuda attention backend's
torch path on the cpu (--attention-backend cuda) generates transformers' greedy tokens (as the cpu backend
does) and names its backend in GetInfo, stats and the metrics; a compute given a cuda pool handle refuses
it with FAILED_PRECONDITION and keeps serving; services asked for a device this host lacks exit with
the reason."""

import subprocess
import sys
import urllib.request

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from protos import common_pb2
from tests.e2e.stack import start_stack
from tests.helpers import ROOT

pytestmark = pytest.mark.e2e

PROMPTS = [[5, 17, 200, 33, 9, 61, 140, 7, 88, 3, 250, 19, 44, 100, 2, 71, 12, 90], [8, 4, 150, 6]]
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def stack(model, logs):
    flags = ("--model", str(model), "--dtype", "float32", "--kv-memory", "1MiB")
    started = start_stack(logs, *flags, "--attention-backend", "cuda")
    try:
        yield started
    finally:
        assert started.stop() == 0


def greedy(model_dir, prompt: list[int], steps: int) -> list[int]:
    """transformers' own greedy tokens (its SDPA attention, no EOS stop), which the cpu backend equals."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    hf.eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_the_cuda_backend_generates_transformers_greedy_tokens(stack, model):
    with stack.client() as client:
        outputs = [client.generate(token_ids=prompt, **GREEDY).token_ids for prompt in PROMPTS]
        again = client.generate(token_ids=PROMPTS[0], **GREEDY).token_ids  # a prefix hit
    expected = [greedy(model, prompt, GREEDY["max_tokens"]) for prompt in PROMPTS]
    assert len(set(expected[0])) > 1, "a degenerate model would not test attention"
    assert list(map(list, outputs)) == expected and list(again) == expected[0]


def test_info_and_metrics_name_device_kv_dtype_and_backend(stack):
    with stack.client() as client:
        info = client.info()
    assert (info.device, info.kv_dtype, info.attention_backend) == ("cpu", "float32", "cuda")
    stats = stack.stats()
    assert (stats.device, stats.kv_dtype, stats.attention_backend) == ("cpu", "float32", "cuda")
    compute = urllib.request.urlopen(stack.metrics_url("compute"), timeout=10).read().decode()
    line = next(line for line in compute.splitlines() if line.startswith("pagedserve_compute_info{"))
    assert 'device="cpu"' in line and 'attention_backend="cuda"' in line and 'kv_dtype="float32"' in line


def test_compute_refuses_a_pool_on_another_device_and_keeps_serving(stack):
    handle = common_pb2.PoolHandle(
        device="cuda:0",
        shape=[2, 2, 8, 16, 2, 16],
        dtype="float32",
        strides=[8192, 4096, 512, 32, 16, 1],
        epoch="0" * 32,
        cuda=common_pb2.DeviceIpcHandle(uuid="GPU-x", ipc_handle=b"h", nbytes=65536),
    )
    with pytest.raises(grpc.RpcError) as err:
        stack.compute().AttachPool(handle, timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "the pool is on cuda:0, this compute service runs on the cpu" in err.value.details()
    with stack.client() as client:
        assert len(client.generate(token_ids=PROMPTS[1], **GREEDY).token_ids) == 8


def service_refusal(module: str, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", module, "--insecure", "--port", "0", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: nothing to refuse")
def test_services_asked_for_a_missing_device_exit_with_the_reason(model):
    cache = service_refusal("cache_service", "--kv-device", "cuda:0")
    assert cache.returncode == 2 and "--kv-device cuda:0: cuda:0: no CUDA device is visible" in cache.stderr
    compute = service_refusal("compute_service", "--model", str(model), "--kv-device", "npu")
    assert compute.returncode != 0 and "the npu attention backend needs torch_npu" in compute.stderr
