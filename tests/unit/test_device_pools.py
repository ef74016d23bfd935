"""Pool handles on accelerators (common/device_pool.py), cache and compute's paths to them, tested where no
accelerator exists with a fake IPC (tests/fake_device.py): the round trip, and each refusal naming its fix."""

import sys
from types import SimpleNamespace

import pytest
import torch

from cache_service import device_room
from cache_service.kv_pool import KVPool
from common import device_ipc, device_pool
from common.devices import CPU, Device, parse_device
from common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from common.shared_pool import PoolSpec
from compute_service import kv_pool
from compute_service.server import ComputeServicer
from protos import common_pb2
from tests.fake_device import FakeIpc

SPEC = PoolSpec(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
CUDA0, CUDA1 = Device("cuda", 0), Device("cuda", 1)


@pytest.fixture
def fake(monkeypatch) -> FakeIpc:
    """A fake CUDA (two devices) that common.device_ipc.ipc_for hands out."""
    ipc = FakeIpc("cuda")
    monkeypatch.setitem(device_ipc.IPC, "cuda", lambda: ipc)
    return ipc


def test_device_names_parse_and_print():
    assert parse_device("cpu") == CPU and str(CPU) == "cpu"
    assert parse_device("cuda") == CUDA0 and str(parse_device("cuda:3")) == "cuda:3"
    assert parse_device("npu:1") == Device("npu", 1)
    for bad in ("gpu", "cuda:x", "cpu:0", "cuda:-1", ""):
        with pytest.raises(InvalidArgument, match="choose cpu, cuda"):
            parse_device(bad)


def test_a_device_pool_round_trips_through_its_handle(fake):
    pool, handle = device_pool.create(SPEC, CUDA0, fake)
    assert handle.device == "cuda:0" and handle.WhichOneof("payload") == "cuda"
    assert (
        handle.cuda.uuid == "GPU-fake-0"
        and handle.cuda.nbytes == SPEC.nbytes
        and len(handle.cuda.token) == 32
    )
    assert list(handle.shape) == list(SPEC.shape) and handle.dtype == "bfloat16"
    mapped = device_pool.open_pool(handle, CUDA0, fake)
    assert mapped.shape == SPEC.shape and mapped.dtype == SPEC.dtype and not mapped.any()
    pool[1, 0, 2].fill_(3.0)
    assert mapped[1, 0, 2].eq(3.0).all() and mapped.sum() == 3.0 * 4 * 2 * 8, "one memory, two views"


def test_compute_maps_only_on_the_device_with_the_pools_uuid(fake):
    _, handle = device_pool.create(SPEC, CUDA0, fake)
    with pytest.raises(FailedPrecondition, match="UUID GPU-fake-0, this compute service runs on cuda:1"):
        device_pool.open_pool(handle, CUDA1, fake)
    renumbered = FakeIpc("cuda", uuids=("GPU-other", "GPU-fake-0"))
    renumbered.exported = fake.exported
    assert device_pool.open_pool(handle, CUDA1, renumbered).shape == SPEC.shape, "matched by UUID, not index"


def tampered(handle: common_pb2.PoolHandle, **changes) -> common_pb2.PoolHandle:
    copy = common_pb2.PoolHandle()
    copy.CopyFrom(handle)
    for name, value in changes.items():
        target = copy.cuda if name in common_pb2.DeviceIpcHandle.DESCRIPTOR.fields_by_name else copy
        if isinstance(value, list):
            del getattr(target, name)[:]
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    return copy


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"epoch": "0" * 32}, InvalidArgument, "does not match the handle's epoch"),
        ({"token": b"x" * 32}, InvalidArgument, "does not match the handle's token"),
        ({"dtype": "float16"}, InvalidArgument, "does not match the handle's dtype"),
        ({"shape": [2, 2, 3, 4, 2, 8 * 2]}, InvalidArgument, "handle size .* does not match shape"),
        ({"shape": [2, 3, 3, 4, 2, 8]}, InvalidArgument, "pool shape must be"),
        ({"nbytes": 7}, InvalidArgument, "handle size 7 does not match"),
        ({"storage_size_bytes": 100}, InvalidArgument, "exported allocation holds 100 bytes"),
        ({"strides": [1, 1, 1, 1, 1, 1]}, InvalidArgument, "strides .* are not contiguous"),
        ({"dtype": "int4"}, InvalidArgument, "unsupported dtype 'int4'"),
        ({"uuid": "GPU-elsewhere"}, FailedPrecondition, "UUID GPU-elsewhere"),
        (
            {"ipc_handle": b"forged"},
            FailedPrecondition,
            "IPC handle cannot be opened on cuda:0 .*its cache exited",
        ),
    ],
)
def test_a_device_handle_that_does_not_match_its_pool_is_refused(fake, changes, error, message):
    _, handle = device_pool.create(SPEC, CUDA0, fake)
    with pytest.raises(error, match=message):
        device_pool.open_pool(tampered(handle, **changes), CUDA0, fake)


def test_a_handle_for_another_device_is_refused_naming_both(fake, tmp_path, monkeypatch):
    _, cuda_handle = device_pool.create(SPEC, CUDA0, fake)
    with pytest.raises(
        FailedPrecondition, match="the pool is on cuda:0, this compute service runs on the cpu"
    ):
        kv_pool.map_kv_pool(cuda_handle, CPU)
    npu = Device("npu", 0)
    with pytest.raises(FailedPrecondition, match=r"the pool is on cuda:0 \(cuda handle\).* runs on npu:0"):
        device_pool.open_pool(cuda_handle, npu, FakeIpc("npu"))
    cpu_handle = common_pb2.PoolHandle(device="cpu", shm=common_pb2.SharedMemoryHandle(path="/dev/shm/x"))
    with pytest.raises(FailedPrecondition, match=r"the pool is on cpu \(shm handle\).* runs on cuda:0"):
        kv_pool.map_kv_pool(cpu_handle, CUDA0)


def test_the_cache_creates_a_device_pool_and_compute_attaches_it(fake):
    kv = KVPool.create(SPEC, "tiny", "freelist", True, device=CUDA0)
    try:
        assert kv.handle.device == "cuda:0" and kv.handle.cuda.uuid == "GPU-fake-0"
        spec = SimpleNamespace(
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
            kv_dtype_name="bfloat16",
            kv_scales=SimpleNamespace(identity=""),
            plan=SimpleNamespace(sparse_attention=None),
            sliding_windows=(0, 0),
            pooling=None,
            tensor_parallel_size=1,
            vision=None,
        )
        spec.vocab_size, spec.max_model_len, spec.attention_backend = 10, 64, "cuda"
        runner = SimpleNamespace(
            attach=lambda pool, layout: setattr(runner, "pool", pool), group=None, vision=None
        )
        servicer = ComputeServicer(runner, spec, SimpleNamespace(info=lambda *a, **k: None), CUDA0)
        reply = servicer.AttachPool(kv.handle, None)
        assert (reply.epoch, reply.num_blocks) == (kv.handle.epoch, 3)
        kv.tensor[0, 1, 2, 3].fill_(5.0)
        assert runner.pool[0, 1, 2, 3].eq(5.0).all(), "compute sees the cache's writes"
        assert servicer.stepper.drop_removed_pool() is False, "a device pool has no segment file to lose"
        with pytest.raises(FailedPrecondition, match="UUID GPU-fake-0, this compute service runs on cuda:1"):
            ComputeServicer(runner, spec, None, CUDA1).AttachPool(kv.handle, None)
        spec.attention_backend = "npu"
        with pytest.raises(
            InvalidArgument, match="multiple of 128 tokens, the pool's are 4: .*--block-size 128"
        ):
            servicer.AttachPool(kv.handle, None)
    finally:
        kv.release()


def test_a_device_pool_that_does_not_fit_is_refused_before_allocating(fake):
    fake.free = SPEC.nbytes
    allocated = []
    fake.allocate = lambda index, nbytes: allocated.append(nbytes)
    with pytest.raises(ResourceExhausted, match="does not fit cuda:0.*give a smaller --kv-memory"):
        device_room.create(SPEC, CUDA0)
    assert allocated == []


def test_the_cache_refuses_a_device_it_cannot_use(fake):
    assert device_room.refusal(CUDA1, 0) is None
    assert "cuda:2: no such fake device" in device_room.refusal(Device("cuda", 2), 0)
    assert "--kv-memory" in device_room.refusal(CPU, 2**62)
    assert "--kv-tier rocksdb reads the pool through host memory" in device_room.refusal(CUDA0, 0, "rocksdb")
    assert device_room.refusal(CPU, 0, "rocksdb") is None


def test_without_a_gpu_cuda_is_refused_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here: the refusal is for hosts without one")
    with pytest.raises(FailedPrecondition, match=r"no CUDA device is visible \(torch.cuda.is_available"):
        device_ipc.ipc_for(CUDA0)


def test_npu_without_torch_npu_is_refused_only_when_selected(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(FailedPrecondition, match=r"needs torch_npu .*pip install -e '.\[npu\]'"):
        device_ipc.ipc_for(Device("npu", 0))
    assert device_room.refusal(CPU, 0) is None, "the cpu never imports it"


def test_npu_ipc_needs_a_torch_npu_that_shares_memory(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", SimpleNamespace(__version__="2.1.0"))
    monkeypatch.delattr(torch.UntypedStorage, "_share_npu_", raising=False)
    with pytest.raises(FailedPrecondition, match="torch_npu 2.1.0 cannot share NPU memory.*7.2 or later"):
        device_ipc.ipc_for(Device("npu", 0))
