"""The segment's header and open_pool's refusals: compute maps only the segment the cache created for the
handle (a regular file owned by its uid, mode 0600, one link, the right size, a header matching the handle);
every refusal maps nothing. Segments live in tmp_path here, never in /dev/shm."""

import os
from pathlib import Path

import pytest
import torch

from common import segment_header, shared_pool
from common.errors import FailedPrecondition, InvalidArgument
from common.segment_header import HEADER_BYTES, MAGIC, SegmentHeader
from common.shm_files import SEGMENT_PREFIX
from protos import common_pb2

SPEC = shared_pool.PoolSpec(
    num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32
)
NOBODY = 65534


@pytest.fixture
def segment(tmp_path):
    tensor, handle = shared_pool.create(SPEC, tmp_path)
    yield tensor, handle
    shared_pool.release(handle)


def _mappings(path: str) -> int:
    return Path("/proc/self/maps").read_text().count(path)


def _refusal(handle: common_pb2.PoolHandle, shm_dir: Path, error=InvalidArgument) -> str:
    before = _mappings(handle.shm.path)
    with pytest.raises(error) as info:
        shared_pool.open_pool(handle, shm_dir)
    assert _mappings(handle.shm.path) == before, "a refused open maps nothing"
    return str(info.value)


def _with(handle: common_pb2.PoolHandle, **fields) -> common_pb2.PoolHandle:
    forged = common_pb2.PoolHandle()
    forged.CopyFrom(handle)
    for name, value in fields.items():
        target, _, field = name.rpartition("__")
        setattr(getattr(forged, target) if target else forged, field, value)
    return forged


GROUPS = [common_pb2.KVGroupLayout(layers=[0, 2], window=64), common_pb2.KVGroupLayout(layers=[1, 3])]


def test_header_round_trips_and_names_what_differs():
    handle = common_pb2.PoolHandle(
        epoch="ab" * 16, dtype="bfloat16", shape=(2, 2, 100, 16, 3, 64), kv_groups=GROUPS
    )
    header = SegmentHeader.new(handle.epoch, handle.dtype, handle.shape, handle.kv_groups)
    data = header.pack()
    assert len(data) == HEADER_BYTES and data.startswith(MAGIC)
    assert SegmentHeader.unpack(data) == header
    assert header.mismatches(handle, header.token) == []
    other = common_pb2.PoolHandle(epoch="cd" * 16, dtype="float32", shape=(2, 2, 100, 16, 3, 32))
    assert header.mismatches(other, bytes(32)) == ["epoch", "dtype", "shape", "kv_groups", "token"]
    assert SegmentHeader.unpack(bytes(HEADER_BYTES)) is None
    assert SegmentHeader.unpack(MAGIC) is None, "a short header is no header"


def test_create_writes_the_header_after_the_data_and_a_mode_0600_file(segment, tmp_path):
    tensor, handle = segment
    info = os.stat(handle.shm.path)
    assert info.st_size == SPEC.nbytes + HEADER_BYTES and info.st_mode & 0o777 == 0o600
    fd = os.open(handle.shm.path, os.O_RDONLY)
    try:
        header = segment_header.read(fd, SPEC.nbytes)
    finally:
        os.close(fd)
    assert header == SegmentHeader.of(handle, handle.shm.token)
    assert header.groups == segment_header.groups_digest([]), "no groups given: one group of every layer"
    assert len(set(handle.shm.token)) > 1, "a random token"
    assert tensor.shape == SPEC.shape and not tensor.any()


def test_open_maps_the_same_memory(segment, tmp_path):
    tensor, handle = segment
    pool = shared_pool.open_pool(handle, tmp_path)
    pool[1, 0, 3] = 7.0
    assert tensor[1, 0, 3].eq(7.0).all()
    tensor.zero_()


def test_a_symlink_to_the_real_segment_is_refused(segment, tmp_path):
    _, handle = segment
    link = tmp_path / f"{SEGMENT_PREFIX}link"
    link.symlink_to(handle.shm.path)
    assert "is a symbolic link" in _refusal(_with(handle, shm__path=str(link)), tmp_path)


def test_a_segment_of_another_owner_is_refused(segment, tmp_path):
    _, handle = segment
    os.chown(handle.shm.path, NOBODY, NOBODY)
    assert f"owned by uid {NOBODY}, not by this service's uid {os.geteuid()}" in _refusal(handle, tmp_path)


def test_a_segment_others_can_read_is_refused(segment, tmp_path):
    _, handle = segment
    os.chmod(handle.shm.path, 0o644)
    assert "its mode is 0644, not 0600" in _refusal(handle, tmp_path)


def test_a_hard_link_is_refused(segment, tmp_path):
    _, handle = segment
    link = tmp_path / f"{SEGMENT_PREFIX}hard"
    os.link(handle.shm.path, link)
    assert "it has 2 links, not 1" in _refusal(_with(handle, shm__path=str(link)), tmp_path)


@pytest.mark.parametrize(
    ("forged", "differs"),
    [
        (dict(shm__token=bytes(32)), "token"),
        (dict(shm__token=b""), "token"),
        (dict(epoch="0" * 32), "epoch"),
    ],
)
def test_a_handle_that_does_not_match_the_header_is_refused(segment, tmp_path, forged, differs):
    _, handle = segment
    assert f"its header does not match the handle's {differs}" in _refusal(_with(handle, **forged), tmp_path)


def test_a_grouped_segment_opens_only_with_its_kv_groups(tmp_path):
    _, handle = shared_pool.create(SPEC, tmp_path, GROUPS)
    try:
        assert [list(group.layers) for group in handle.kv_groups] == [[0, 2], [1, 3]]
        assert shared_pool.open_pool(handle, tmp_path).shape == SPEC.shape
        swapped = _with(handle)
        swapped.kv_groups[0].window = 0  # the same slots, read as a full group
        assert "its header does not match the handle's kv_groups" in _refusal(swapped, tmp_path)
        del swapped.kv_groups[:]
        assert "its header does not match the handle's kv_groups" in _refusal(swapped, tmp_path)
    finally:
        shared_pool.release(handle)


def test_a_truncated_segment_is_refused(segment, tmp_path):
    _, handle = segment
    os.truncate(handle.shm.path, SPEC.nbytes)
    assert f"holds {SPEC.nbytes} bytes" in _refusal(handle, tmp_path)


def test_a_segment_without_the_magic_is_refused(segment, tmp_path):
    _, handle = segment
    with open(handle.shm.path, "r+b") as file:
        file.seek(SPEC.nbytes)
        file.write(b"\x00" * len(MAGIC))
    assert "no pagedserve segment header (magic missing)" in _refusal(handle, tmp_path)


def test_a_fifo_under_the_name_is_refused_without_blocking(segment, tmp_path):
    _, handle = segment
    fifo = tmp_path / f"{SEGMENT_PREFIX}fifo"
    os.mkfifo(fifo, 0o600)
    assert "not a regular file" in _refusal(_with(handle, shm__path=str(fifo)), tmp_path)


def test_a_gone_segment_and_a_path_elsewhere_are_refused(segment, tmp_path):
    _, handle = segment
    gone = _with(handle, shm__path=str(tmp_path / f"{SEGMENT_PREFIX}gone"))
    assert "is gone" in _refusal(gone, tmp_path, FailedPrecondition)
    assert "is not a pagedserve pool segment" in _refusal(handle, tmp_path / "elsewhere")
    nul = _with(handle, shm__path=handle.shm.path + "\0")
    assert "is not a pagedserve pool segment" in _refusal(nul, tmp_path)


def test_a_handle_inconsistent_in_itself_is_refused(segment, tmp_path):
    _, handle = segment
    assert "does not match shape" in _refusal(_with(handle, shm__nbytes=SPEC.nbytes + 4), tmp_path)
    bad_shape = _with(handle)
    bad_shape.shape[1] = 3
    assert "pool shape must be" in _refusal(bad_shape, tmp_path)


def _resident_kib(path: str) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    resident, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split()[0]:  # a mapping's header line
            inside = line.endswith(path)
        elif inside and line.startswith("Rss:"):
            resident += int(line.split()[1])
    return resident


def test_create_and_open_map_every_page_up_front(segment, tmp_path):
    """The cache's pool and compute's mapping of it are resident before anything touches them: no first-touch
    page faults on the serving path."""
    tensor, handle = segment
    size_kib = SPEC.nbytes // 1024
    assert _resident_kib(handle.shm.path) >= size_kib
    before = _resident_kib(handle.shm.path)
    opened = shared_pool.open_pool(handle, tmp_path)
    assert _resident_kib(handle.shm.path) - before >= size_kib, "compute's mapping is populated too"
    assert torch.equal(opened, tensor)
