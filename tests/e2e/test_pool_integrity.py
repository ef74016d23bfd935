"""Attacks on the pool from another local process, each now harmless: redirecting compute to a file the
attacker made, creating a pool the host cannot back, replacing the live pool's layout, reading raw K/V.
A real cache process (the small geometry) and a real compute process (the tiny model, the same geometry)."""

import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from common.segment_header import SegmentHeader
from common.server import channel
from common.shared_pool import PoolSpec, create, release
from common.shm_files import SEGMENT_PREFIX, SHM_DIR
from protos import cache_pb2, common_pb2, compute_pb2_grpc
from tests.e2e.cache_process import HEAD_DIM, HEADS, LAYERS, Service, pool_request, refused
from tests.forward import forward_request
from tests.helpers import free_port, start, stop, wait_healthy
from tests.processes import segments_of
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e

BLOCK_SIZE, NUM_BLOCKS = 4, 32
PROMPT = [100, 3, 44, 55, 66, 77, 88]
NOBODY = 65534
# How much a refused CreatePool may grow the cache's resident memory (allocator noise, gRPC buffers).
RSS_BOUND = 16 * 2**20


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    service = Service(tmp_path_factory.mktemp("cache"), "--kv-blocks", str(NUM_BLOCKS))
    try:
        yield service
    finally:
        service.stop()
    assert not segments_of(service.proc.pid)


@pytest.fixture(scope="module")
def handle(cache):
    return cache.stub.CreatePool(pool_request(BLOCK_SIZE))


@pytest.fixture(scope="module")
def compute(tmp_path_factory, handle):
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", initializer_range=0.3)
    port = free_port()
    args = ["--model", str(model_dir), "--dtype", "float32", "--port", str(port), "--threads", "2"]
    args.append("--insecure")
    log_path = tmp_path_factory.mktemp("logs") / "compute.log"
    proc = start("compute_service", *args, log_path=log_path)
    try:
        wait_healthy(f"127.0.0.1:{port}", proc, timeout=120)
        with channel(f"127.0.0.1:{port}") as ch:
            stub = compute_pb2_grpc.ComputeStub(ch)
            stub.AttachPool(handle, timeout=30)
            yield stub
    finally:
        assert stop(proc) == 0
    assert handle.shm.token.hex() not in log_path.read_text()


def greedy(compute, epoch: str, table: list[int], steps: int = 6) -> list[int]:
    """PROMPT's greedy continuation, its K/V in the table's blocks of the attached pool."""
    generated, new, cached = [], PROMPT, 0
    for _ in range(steps):
        request = forward_request([new], [cached], [table], block_size=BLOCK_SIZE, epoch=epoch)
        (token,) = compute.Forward(request, timeout=60).token_ids
        generated.append(token)
        cached, new = cached + len(new), [token]
    return generated


def forged_handle(handle: common_pb2.PoolHandle, path: Path, token: bytes) -> common_pb2.PoolHandle:
    forged = common_pb2.PoolHandle()
    forged.CopyFrom(handle)
    forged.shm.path, forged.shm.token = str(path), token
    return forged


def as_nobody(command: list[str], data: bytes = b"") -> None:
    """Runs a command as uid/gid 65534: another local user, bound by file permissions."""
    subprocess.run(command, input=data, user=NOBODY, group=NOBODY, check=True, timeout=30)


@pytest.fixture
def planted():
    """Paths in the shm dir for an attacker to plant; removed afterwards."""
    paths = []

    def path() -> Path:
        paths.append(SHM_DIR / f"{SEGMENT_PREFIX}{uuid.uuid4().hex}")
        return paths[-1]

    yield path
    for path_ in paths:
        path_.unlink(missing_ok=True)


def test_attach_pool_refuses_files_the_cache_did_not_create_and_keeps_the_real_pool(
    cache, handle, compute, planted
):
    """Before: AttachPool of a 0644 file an attacker made with the live epoch was accepted; other requests'
    K/V went into the attacker's file and outputs turned to garbage."""
    epoch = cache.stats().pool_epoch
    before = greedy(compute, epoch, [0, 1, 2, 3])
    token = os.urandom(32)
    header = SegmentHeader.of(handle, token).pack()
    attacker_file = planted()
    assert handle.shm.nbytes % len(header) == 0
    # a file of the segment's size, mode 0644 (umask 022), the forged header after the data
    seek = handle.shm.nbytes // len(header)
    as_nobody(
        ["sh", "-c", f"umask 022 && dd of={attacker_file} bs={len(header)} seek={seek} status=none"], header
    )
    link = planted()
    as_nobody(["ln", "-s", handle.shm.path, str(link)])
    _, other_pool = create(
        PoolSpec(LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, torch.float32), groups=handle.kv_groups
    )
    try:
        attempts = {  # what the attacker names, and why compute refuses it
            "owned by uid 65534": forged_handle(handle, attacker_file, token),
            "is a symbolic link": forged_handle(handle, link, handle.shm.token),
            # another stack's segment on this host (our uid, mode 0600), named with this pool's epoch
            "does not match the handle's epoch, token": forged_handle(
                handle, Path(other_pool.shm.path), handle.shm.token
            ),
        }
        for reason, forged in attempts.items():
            with pytest.raises(grpc.RpcError) as info:
                compute.AttachPool(forged, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert reason in info.value.details(), info.value.details()
            assert "pass the handle its CreatePool returned" in info.value.details()
    finally:
        release(other_pool)
    assert greedy(compute, epoch, [4, 5, 6, 7]) == before, "compute still writes and reads the real pool"
    assert not attacker_file.read_bytes()[: handle.shm.nbytes].strip(b"\x00"), "nothing was written there"


def test_the_token_is_in_no_stats_and_no_log(cache, handle):
    token = handle.shm.token
    assert len(token) == 32
    assert token not in cache.stats().SerializeToString()
    assert token.hex() not in cache.log() and repr(token)[2:-1] not in cache.log()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_a_pool_the_host_cannot_back_is_refused_at_once(tmp_path):
    """Before: CreatePool with memory_bytes 10**15 grew the cache to 18 GB until the OOM killer ended it."""
    service = Service(tmp_path)
    try:
        rss = _rss(service.proc.pid)
        start_s = time.monotonic()
        huge = pool_request(1024, memory_bytes=10**15)  # ~1.9e9 blocks of 512 KiB: ids fit in int32
        details = refused(service.stub.CreatePool, huge, grpc.StatusCode.RESOURCE_EXHAUSTED)
        # NOTE: a generous bound (milliseconds here): refused before allocating, on a loaded host too.
        assert time.monotonic() - start_s < 5.0
        assert "does not fit this host" in details and "MemAvailable" in details
        size = r"\d+ bytes \([\d.]+ GiB\)"
        assert re.search(rf"{SHM_DIR} has {size} free and {size} of memory is available", details), details
        absurd = pool_request(num_blocks=2**31)
        assert "block ids" in refused(service.stub.CreatePool, absurd, grpc.StatusCode.INVALID_ARGUMENT)
        assert _rss(service.proc.pid) - rss < RSS_BOUND
        stats = service.stats()
        assert (stats.total_blocks, stats.pool_epoch) == (0, "")
        assert not segments_of(service.proc.pid)
        assert service.stub.CreatePool(pool_request(num_blocks=4)).epoch, "the cache still creates a pool"
    finally:
        assert service.stop() == 0


@pytest.mark.parametrize(
    ("request_", "changed"),
    [
        (pool_request(BLOCK_SIZE * 2), "block_size 8"),
        (pool_request(BLOCK_SIZE, model="another-model"), "model 'another-model'"),
        (
            cache_pb2.CreatePoolRequest(
                geometry=cache_pb2.PoolGeometry(num_layers=3, num_kv_heads=HEADS, head_dim=HEAD_DIM),
                block_size=BLOCK_SIZE,
                kv_dtype="float32",
            ),
            "3 layers",
        ),  # fmt: skip
        (
            cache_pb2.CreatePoolRequest(
                geometry=pool_request().geometry, block_size=BLOCK_SIZE, kv_dtype="bfloat16"
            ),
            "bfloat16",
        ),  # fmt: skip
    ],
)
def test_the_live_pool_keeps_its_layout(cache, handle, compute, request_, changed):
    """Before: CreatePool with another block size while idle replaced the live pool (and crashed the
    gateway's engine thread)."""
    details = refused(cache.stub.CreatePool, request_, grpc.StatusCode.FAILED_PRECONDITION)
    assert changed in details and "restart the cache service to change the layout" in details
    stats = cache.stats()
    assert (stats.pool_epoch, stats.block_size, stats.total_blocks) == (handle.epoch, BLOCK_SIZE, NUM_BLOCKS)
    assert Path(handle.shm.path).exists()
    assert cache.stub.CreatePool(pool_request(BLOCK_SIZE)) == handle, "the same layout: the same handle"
    compute.Forward(forward_request([PROMPT], [0], [[8, 9]], block_size=BLOCK_SIZE, epoch=handle.epoch))


def test_raw_kv_needs_the_debug_flag(cache, handle):
    """Before: ReadBlock include_data returned any block's raw K/V, from which a victim's prompt was
    recovered. (tests/e2e/test_cache_service.py reads data from a cache started with the flag.)"""
    request = cache_pb2.ReadBlockRequest(block_id=0, layer=0, include_data=True)
    assert "--debug-read-kv" in refused(cache.stub.ReadBlock, request, grpc.StatusCode.FAILED_PRECONDITION)
    meta = cache.stub.ReadBlock(cache_pb2.ReadBlockRequest(block_id=0, layer=0))
    assert (meta.refcount, meta.data, list(meta.shape)) == (0, b"", [2, BLOCK_SIZE, HEADS, HEAD_DIM])
