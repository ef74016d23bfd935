"""The size checks of CreatePool: a pool is refused unless the host can back it (shm free space, a share of
available memory, with the bookkeeping per block), and absurd budgets are refused as invalid."""

import pytest

from cache_service import host_memory
from cache_service.host_memory import BOOKKEEPING_BYTES_PER_BLOCK, MEMORY_SHARE, HostRoom, require_room
from cache_service.kv_pool import MAX_BLOCKS, spec_from_request
from common.errors import InvalidArgument, ResourceExhausted
from common.segment_header import HEADER_BYTES
from protos import cache_pb2

GIB = 2**30


def test_a_pool_that_fits_both_is_accepted_up_to_the_byte():
    blocks = 1000
    memory = GIB + HEADER_BYTES + blocks * BOOKKEEPING_BYTES_PER_BLOCK
    room = HostRoom(shm_free=GIB + HEADER_BYTES, memory_available=memory / MEMORY_SHARE)
    require_room(GIB, blocks, room, "/shm")


def test_a_pool_beyond_the_shm_free_space_is_refused_naming_the_numbers():
    room = HostRoom(shm_free=GIB + HEADER_BYTES - 1, memory_available=100 * GIB)
    with pytest.raises(ResourceExhausted) as info:
        require_room(GIB, 0, room, "/shm")
    message = str(info.value)
    assert f"a pool of {GIB} bytes (1.00 GiB) does not fit this host" in message
    assert f"/shm has {GIB + HEADER_BYTES - 1} bytes" in message
    assert f"{100 * GIB} bytes (100.00 GiB) of memory is available" in message
    assert "--kv-memory" in message


def test_a_pool_beyond_the_share_of_available_memory_is_refused():
    blocks = 10**6
    needed = GIB + HEADER_BYTES + blocks * BOOKKEEPING_BYTES_PER_BLOCK
    room = HostRoom(shm_free=100 * GIB, memory_available=needed / MEMORY_SHARE - 1)
    with pytest.raises(ResourceExhausted) as info:
        require_room(GIB, blocks, room, "/shm")
    assert f"{needed} bytes" in str(info.value), "the memory need counts the bookkeeping"
    require_room(GIB, 0, room, "/shm")


def test_the_petabyte_pool_is_refused_on_this_host():
    with pytest.raises(ResourceExhausted, match="does not fit this host"):
        host_memory.require_room_here(10**15, 10**9)


def test_meminfo_and_cgroup_are_read(tmp_path):
    meminfo = "MemTotal:       24684544 kB\nMemFree:  1000 kB\nMemAvailable:   24199168 kB\n"
    assert host_memory._meminfo_available(meminfo) == 24199168 * 1024
    with pytest.raises(ValueError):
        host_memory._meminfo_available("MemTotal: 1 kB\n")
    assert host_memory._cgroup_room(tmp_path) == float("inf")
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("100\n")
    assert host_memory._cgroup_room(tmp_path) == float("inf")
    (tmp_path / "memory.max").write_text(f"{GIB}\n")
    assert host_memory._cgroup_room(tmp_path) == GIB - 100
    assert 0 < host_memory.memory_available() < float("inf")


def _request(block_size: int = 16, **fields) -> cache_pb2.CreatePoolRequest:
    geometry = cache_pb2.PoolGeometry(num_layers=2, num_kv_heads=2, head_dim=16)
    geometry.MergeFrom(fields.pop("geometry", cache_pb2.PoolGeometry()))
    return cache_pb2.CreatePoolRequest(geometry=geometry, block_size=block_size, kv_dtype="float32", **fields)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (_request(num_blocks=-1), "budget must be >= 0"),
        (_request(memory_bytes=-(2**63)), "budget must be >= 0"),
        (_request(num_blocks=MAX_BLOCKS + 1), "more than block ids can address"),
        (_request(memory_bytes=2**63 - 1), "more than block ids can address"),
        (_request(geometry=cache_pb2.PoolGeometry(num_layers=-5)), "geometry.num_layers must be > 0"),
        (
            _request(1024, num_blocks=2**20, geometry=cache_pb2.PoolGeometry(num_layers=2**31 - 1)),
            "more than a handle can address",
        ),
    ],
)
def test_absurd_budgets_and_geometries_are_invalid(request_, message):
    with pytest.raises(InvalidArgument, match=message):
        spec_from_request(request_, 0, 0)
