"""The segment: the shared memory holding the KV pool tensor, created by the cache service (its owner) and
mapped zero-copy by the compute service through a PoolHandle. (The KV pool is the tensor, see
cache_service/kv_pool.py; the block pool is the refcounted block ids, see cache_service/block_pool.py.)"""

import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import FailedPrecondition, InvalidArgument
from protos import common_pb2

SHM_DIR = Path(os.environ.get("PAGEDSERVE_SHM_DIR", "/dev/shm"))
SEGMENT_PREFIX = "pagedserve-kv-"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InvalidArgument(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PoolSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        return math.prod(self.shape) // self.num_blocks * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.num_blocks


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Removes segments left by owners that died without unlinking them."""
    removed = []
    for path in shm_dir.glob(f"{SEGMENT_PREFIX}*"):
        owner = path.name.removeprefix(SEGMENT_PREFIX).split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def remove_segments_of(pid: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Removes the segments that process pid created; for whoever sees that owner exit."""
    assert pid != os.getpid(), "an owner releases its own segments"
    removed = sorted(shm_dir.glob(f"{SEGMENT_PREFIX}{pid}-*"))
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def create(spec: PoolSpec, shm_dir: Path = SHM_DIR) -> tuple[torch.Tensor, common_pb2.PoolHandle]:
    """Creates a zeroed, fully backed shared-memory pool; the caller owns it and must `release` it."""
    epoch = uuid.uuid4().hex
    path = shm_dir / f"{SEGMENT_PREFIX}{os.getpid()}-{epoch}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # NOTE: a sparse tmpfs file raises SIGBUS when an unbacked page is touched; reserve every page now.
        os.posix_fallocate(fd, 0, spec.nbytes)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise FailedPrecondition(
            f"cannot reserve {spec.nbytes / 2**20:.0f} MiB in {shm_dir} ({exc.strerror}): "
            "lower --kv-memory/--kv-blocks or enlarge the shared memory (docker: shm_size)"
        ) from exc
    os.close(fd)
    pool = torch.from_file(str(path), shared=True, size=math.prod(spec.shape), dtype=spec.dtype).view(
        spec.shape
    )
    handle = common_pb2.PoolHandle(
        device="cpu",
        shape=spec.shape,
        dtype=dtype_name(spec.dtype),
        strides=pool.stride(),
        epoch=epoch,
        shm=common_pb2.SharedMemoryHandle(path=str(path), nbytes=spec.nbytes),
    )
    return pool, handle


def release(handle: common_pb2.PoolHandle) -> None:
    if handle.WhichOneof("payload") == "shm":
        Path(handle.shm.path).unlink(missing_ok=True)


def open_pool(handle: common_pb2.PoolHandle) -> torch.Tensor:
    """Maps a pool from its handle after checking the handle against the segment it names."""
    if handle.device != "cpu" or handle.WhichOneof("payload") != "shm":
        raise InvalidArgument(
            f"this compute service maps cpu shared-memory pools, got device {handle.device!r}"
        )
    if len(handle.shape) != 6:
        raise InvalidArgument(f"pool shape must have 6 dimensions, got {list(handle.shape)}")
    dtype = dtype_from_name(handle.dtype)
    numel = math.prod(handle.shape)
    if handle.shm.nbytes != numel * dtype.itemsize:
        raise InvalidArgument(f"handle size {handle.shm.nbytes} does not match shape {list(handle.shape)}")
    path = Path(handle.shm.path)
    if path.parent != SHM_DIR or not path.name.startswith(SEGMENT_PREFIX):
        raise InvalidArgument(f"{path} is not a pagedserve pool segment")
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise FailedPrecondition(
            f"pool segment {path} is gone: the cache service restarted; re-attach"
        ) from exc
    if size != handle.shm.nbytes:
        raise FailedPrecondition(f"pool segment {path} holds {size} bytes, handle says {handle.shm.nbytes}")
    pool = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(tuple(handle.shape))
    if tuple(pool.stride()) != tuple(handle.strides):
        raise InvalidArgument(f"pool strides {list(handle.strides)} are not contiguous {list(pool.stride())}")
    return pool
