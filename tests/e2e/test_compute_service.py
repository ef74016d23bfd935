"""The compute service as a real process: model info, pool attachment, paged generation, refusals."""

import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from common import shared_pool
from common.server import channel
from compute_service.attention.registry import default_backend
from compute_service.server import SEGMENT_CHECK_S, SEGMENT_REMOVED
from protos import common_pb2, compute_pb2, compute_pb2_grpc
from tests.forward import forward_request as paged_forward_request
from tests.forward import replace_field as _replace
from tests.forward import set_field as _set
from tests.helpers import free_port, start, stop, wait_healthy
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e

BLOCK_SIZE, NUM_BLOCKS, LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 4, 32, 2, 2, 16, 256
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13], [10, 20, 30]]


forward_request = partial(paged_forward_request, block_size=BLOCK_SIZE)


def small_step(epoch: str) -> compute_pb2.ForwardRequest:
    """Two sequences: 6 new tokens on 2 cached ones, and a fresh 3-token prompt."""
    return forward_request([[1, 2, 3, 4, 5, 6], [7, 8, 9]], [2, 0], [[20, 21], [22]], epoch=epoch)


def refusal(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    return info.value


def make_pool(**overrides) -> tuple[torch.Tensor, common_pb2.PoolHandle]:
    geometry = dict(
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
    )
    return shared_pool.create(shared_pool.PoolSpec(**{**geometry, **overrides}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", initializer_range=0.3)


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    port = free_port()
    args = [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--threads",
        "2",
        "--insecure",
    ]
    proc = start("compute_service", *args, log_path=tmp_path_factory.mktemp("logs") / "compute.log")
    target = f"127.0.0.1:{port}"
    try:
        wait_healthy(target, proc, timeout=120)
        with channel(target) as ch:
            stub = compute_pb2_grpc.ComputeStub(ch)
            # before any AttachPool, so it does not depend on test order
            no_pool = refusal(stub.Forward, small_step(""))
            yield SimpleNamespace(stub=stub, no_pool=no_pool, pid=proc.pid)
    finally:
        assert stop(proc) == 0


@pytest.fixture(scope="module")
def pool(service):
    tensor, handle = make_pool()
    try:
        reply = service.stub.AttachPool(handle, timeout=30)
        yield SimpleNamespace(tensor=tensor, handle=handle, epoch=handle.epoch, reply=reply)
    finally:
        shared_pool.release(handle)


def test_model_info(service, model_dir):
    info = service.stub.GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=30)
    assert info.model == model_dir.name
    assert (info.num_layers, info.num_attention_heads, info.num_kv_heads, info.head_dim) == (LAYERS, 4, 2, 16)
    assert (info.dtype, info.vocab_size, info.max_model_len) == ("float32", VOCAB, 512)
    assert list(info.eos_token_ids) == [2]
    assert info.attention_backend == default_backend() == "cpu-native"


def test_forward_before_attach_is_refused(service):
    assert service.no_pool.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "AttachPool" in service.no_pool.details()


def test_attach_reports_the_pool(pool):
    assert pool.reply.epoch == pool.epoch
    assert pool.reply.num_blocks == NUM_BLOCKS


def test_paged_generation_matches_hugging_face_greedy(service, pool, model_dir):
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [blocks[0:6], blocks[6:12], blocks[12:18]]
    generated = [[] for _ in PROMPTS]
    new, cached = PROMPTS, [0] * len(PROMPTS)
    for _ in range(7):
        reply = service.stub.Forward(forward_request(new, cached, tables, epoch=pool.epoch), timeout=60)
        assert len(reply.token_ids) == len(reply.logprobs) == len(PROMPTS)
        assert all(lp <= 0 for lp in reply.logprobs) and reply.forward_ms > 0
        for seq, token in enumerate(reply.token_ids):
            generated[seq].append(token)
        cached = [c + len(n) for c, n in zip(cached, new, strict=True)]
        new = [[token] for token in reply.token_ids]

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for seq, prompt in enumerate(PROMPTS):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False)[
            0, len(prompt) :
        ]
        assert generated[seq][: len(expected)] == expected.tolist()


def _narrow_tables(request: compute_pb2.ForwardRequest) -> None:
    # one column per sequence, too few for sequence 0's 8 tokens
    _replace("block_tables", [20, 22])(request)
    request.block_table_width = 1


def _sampling(**params):
    def mutate(request: compute_pb2.ForwardRequest) -> None:
        request.sampling[1].CopyFrom(compute_pb2.RowSampling(**params))

    return mutate


BAD_REQUESTS = {
    "block outside the pool": (_set("block_tables", 0, NUM_BLOCKS + 3), "outside the pool"),
    "block missing from the table": (_set("block_tables", 1, -1), "block_tables[0][1] = -1"),
    "shared block written": (_set("block_tables", 2, 21), "written by two new tokens"),
    "token outside vocab": (_set("token_ids", 7, VOCAB), "token_ids[7]"),
    "cu_seqlens not increasing": (_replace("cu_seqlens_q", [0, 6, 6, 9]), "cu_seqlens_q"),
    "cu_seqlens not ending at num tokens": (_replace("cu_seqlens_q", [0, 6, 8]), "cu_seqlens_q"),
    "num_computed count": (_replace("num_computed", [2]), "num_computed has 1 entries"),
    "num_computed negative": (_set("num_computed", 0, -1), "num_computed[0]"),
    "context beyond the model": (_set("num_computed", 1, 510), "maximum length 512"),
    "too few table entries": (_replace("block_tables", [20, 22]), "block_tables"),
    "table narrower than the context": (_narrow_tables, "block_table_width is 1"),
    "sampling count": (_replace("sample", [True, False]), "sampling entries"),
    "negative temperature": (_sampling(temperature=-1.0), "temperature"),
    "top_p zero": (_sampling(top_p=0.0), "top_p"),
}


@pytest.mark.parametrize("mutate, message", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_step_is_refused_before_touching_the_pool(service, pool, mutate, message):
    request = small_step(pool.epoch)
    mutate(request)
    before = pool.tensor.clone()
    error = refusal(service.stub.Forward, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    assert torch.equal(pool.tensor, before)


def test_valid_step_writes_exactly_its_slots(service, pool):
    pool.tensor.zero_()
    service.stub.Forward(small_step(pool.epoch), timeout=30)
    written = (pool.tensor != 0).flatten(4).any(-1).any(0).any(0).flatten()  # per slot
    # block_table[p // block_size] * block_size + p % block_size of each new token's position p
    spans = (([20, 21], range(2, 8)), ([22], range(3)))
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for table, span in spans for p in span]
    assert written.nonzero().squeeze(1).tolist() == slots


def test_stale_epoch_is_refused(service, pool):
    error = refusal(service.stub.Forward, small_step("0" * 32))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale pool epoch" in error.details()


@pytest.mark.parametrize(
    "geometry", [dict(head_dim=8), dict(num_kv_heads=1), dict(num_layers=3), dict(dtype=torch.bfloat16)]
)
def test_attach_with_wrong_geometry_is_refused(service, pool, geometry):
    _, handle = make_pool(**geometry)
    try:
        error = refusal(service.stub.AttachPool, handle)
    finally:
        shared_pool.release(handle)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "expected shape" in error.details()
    service.stub.Forward(small_step(pool.epoch), timeout=30)


def test_reattach_replaces_the_pool(service, pool):
    tensor, handle = make_pool()
    try:
        assert service.stub.AttachPool(handle, timeout=30).epoch == handle.epoch
        service.stub.Forward(small_step(handle.epoch), timeout=30)
        assert tensor.abs().sum() > 0
        error = refusal(service.stub.Forward, small_step(pool.epoch))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        service.stub.AttachPool(pool.handle, timeout=30)
        shared_pool.release(handle)


def _mapped(pid: int, path: str) -> bool:
    return path in Path(f"/proc/{pid}/maps").read_text()


def test_a_removed_segment_is_unmapped_and_refused(service, pool):
    _, handle = make_pool()
    try:
        service.stub.AttachPool(handle, timeout=30)
        service.stub.Forward(small_step(handle.epoch), timeout=30)
        assert _mapped(service.pid, handle.shm.path)
        shared_pool.release(handle)  # as a cache's exit does; no Forward comes meanwhile
        deadline = time.monotonic() + 3 * SEGMENT_CHECK_S + 2
        while _mapped(service.pid, handle.shm.path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _mapped(service.pid, handle.shm.path), "compute unmapped the removed segment"
        error = refusal(service.stub.Forward, small_step(handle.epoch))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == SEGMENT_REMOVED
    finally:
        shared_pool.release(handle)
        service.stub.AttachPool(pool.handle, timeout=30)
