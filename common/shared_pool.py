"""The segment: the shared memory holding the KV pool tensor, created by the cache service (its owner) and
mapped zero-copy by the compute service through a PoolHandle. The file is the pool data, then a header page
(common/segment_header.py) by which the compute service refuses any file the cache did not create; its name
is common/shm_files.py's. (The KV pool is the tensor, see cache_service/kv_pool.py; the block pool is the
refcounted block ids, see cache_service/block_pool.py.)"""

import errno
import math
import mmap
import os
import stat
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common import segment_header
from common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from common.segment_header import HEADER_BYTES, SegmentHeader
from common.shm_files import SEGMENT_PREFIX, SHM_DIR
from protos import common_pb2

# The pool's dtypes by the name they travel by (PoolHandle.dtype, --kv-dtype); fp8 ones hold scaled K/V.
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Linux's flag to map every page of a mapping at once (0 elsewhere: pages fault in on first touch).
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InvalidArgument(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point


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


def create(
    spec: PoolSpec, shm_dir: Path = SHM_DIR, groups: Sequence[common_pb2.KVGroupLayout] = ()
) -> tuple[torch.Tensor, common_pb2.PoolHandle]:
    """Creates a zeroed, fully backed shared-memory pool (mode 0600, its header after the data, a new
    epoch and secret token) laid out in `groups` (none: one group of every layer); the caller owns it and
    must `release` it."""
    epoch = uuid.uuid4().hex
    path = shm_dir / f"{SEGMENT_PREFIX}{os.getpid()}-{epoch}"
    header = SegmentHeader.new(epoch, dtype_name(spec.dtype), spec.shape, groups)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # NOTE: exactly 0600 whatever the umask: compute refuses any other mode.
        reserve(fd, spec.nbytes + HEADER_BYTES, shm_dir)
        segment_header.write(fd, spec.nbytes, header)
        pool = _map(fd, spec)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    handle = common_pb2.PoolHandle(
        device="cpu",
        shape=spec.shape,
        dtype=header.dtype,
        strides=pool.stride(),
        epoch=epoch,
        shm=common_pb2.SharedMemoryHandle(path=str(path), nbytes=spec.nbytes, token=header.token),
        kv_groups=groups,
    )
    return pool, handle


def reserve(fd: int, nbytes: int, shm_dir: Path) -> None:
    """Backs every page of the file now (ResourceExhausted if shm_dir cannot hold it).
    NOTE: a sparse tmpfs file raises SIGBUS when an unbacked page is touched."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise ResourceExhausted(
            f"cannot reserve {nbytes / 2**20:.0f} MiB in {shm_dir} ({exc.strerror}): "
            "lower --kv-memory/--kv-blocks or enlarge the shared memory (docker: shm_size)"
        ) from exc


def _map(fd: int, spec: PoolSpec) -> torch.Tensor:
    """The pool tensor over the first spec.nbytes of the open segment fd, shared with every other mapper,
    every page mapped now; the mapping outlives fd and lasts as long as the tensor's storage.

    NOTE: MAP_POPULATE moves every page's first-touch cost to start-up. A tmpfs page that posix_fallocate
    reserved is zeroed at its first fault, and each mapper then takes a fault per page again: in a throughput
    run those faults, taken by compute while storing K/V, were 8-12 % of its CPU time (perf), and a fresh
    server's first requests paid them. Populating costs ~0.5 s per GiB when the cache creates the pool
    (the zeroing) and ~0.1 s per GiB when compute maps it."""
    mapping = mmap.mmap(
        fd, spec.nbytes, flags=mmap.MAP_SHARED | POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
    )
    return torch.frombuffer(mapping, dtype=spec.dtype).view(spec.shape)


def release(handle: common_pb2.PoolHandle) -> None:
    """Unlinks the handle's segment (a cpu pool's), its session fence and its image store."""
    if handle.WhichOneof("payload") == "shm":
        Path(handle.shm.path).unlink(missing_ok=True)
    if handle.HasField("fence"):
        Path(handle.fence.path).unlink(missing_ok=True)
    if handle.HasField("image_store"):
        Path(handle.image_store.path).unlink(missing_ok=True)


def open_pool(handle: common_pb2.PoolHandle, shm_dir: Path = SHM_DIR) -> torch.Tensor:
    """Maps the pool a handle names, only if its segment is one the cache created for this handle: a
    regular file in shm_dir (not a symlink), owned by this process's euid, mode 0600, one link, the pool's
    size plus a header whose magic, epoch, dtype, shape and token match the handle. Every check and the
    mapping use one open fd (no second lookup by path). Raises InvalidArgument, or FailedPrecondition if
    the segment is gone; a refusal maps nothing."""
    spec = _spec_of(handle)
    path = Path(handle.shm.path)
    fd = open_file(path, SEGMENT_PREFIX, spec.nbytes + HEADER_BYTES, shm_dir)
    try:
        check_header(segment_header.read(fd, spec.nbytes), handle, handle.shm.token, path)
        pool = _map(fd, spec)
    finally:
        os.close(fd)
    if tuple(pool.stride()) != tuple(handle.strides):
        raise InvalidArgument(f"pool strides {list(handle.strides)} are not contiguous {list(pool.stride())}")
    return pool


def _spec_of(handle: common_pb2.PoolHandle) -> PoolSpec:
    if handle.device != "cpu" or handle.WhichOneof("payload") != "shm":
        raise InvalidArgument(
            f"this compute service maps cpu shared-memory pools, got device {handle.device!r}"
        )
    return spec_of(handle, handle.shm.nbytes)


def spec_of(handle: common_pb2.PoolHandle, nbytes: int) -> PoolSpec:
    """The pool a handle describes, whatever its device (`nbytes`: its payload's data size);
    InvalidArgument if the handle is not self-consistent."""
    shape = tuple(handle.shape)
    if len(shape) != 6 or shape[1] != 2 or min(shape) < 1:
        raise InvalidArgument(
            f"pool shape must be [layers, 2, blocks, block_size, kv_heads, head_dim] > 0, got {list(shape)}"
        )
    layers, _, blocks, block_size, heads, head_dim = shape
    spec = PoolSpec(layers, blocks, block_size, heads, head_dim, dtype_from_name(handle.dtype))
    if nbytes != spec.nbytes:
        raise InvalidArgument(f"handle size {nbytes} does not match shape {list(shape)}")
    return spec


def open_file(path: Path, prefix: str, size: int, shm_dir: Path = SHM_DIR) -> int:
    """An open fd of path, only if it is a file the cache created: named prefix* in shm_dir, a regular file
    (not a symlink) owned by this process's euid, mode 0600, one link, of `size` bytes. InvalidArgument, or
    FailedPrecondition if it is gone."""
    if path.parent != shm_dir or not path.name.startswith(prefix) or "\0" in path.name:
        raise InvalidArgument(f"{path} is not a pagedserve pool segment ({shm_dir}/{prefix}*)")
    fd = _open_segment(path)
    try:
        _check_file(os.fstat(fd), path, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_segment(path: Path) -> int:
    # NOTE: O_NOFOLLOW refuses a symlink; O_NONBLOCK keeps a FIFO planted under the name from blocking.
    try:
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise FailedPrecondition(
            f"pool segment {path} is gone: the cache service restarted; re-attach"
        ) from exc
    except OSError as exc:
        reason = f"it cannot be opened ({exc.strerror})"
        raise _refused(path, "it is a symbolic link" if exc.errno == errno.ELOOP else reason) from exc


def _check_file(info: os.stat_result, path: Path, size: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise _refused(path, "it is not a regular file")
    if info.st_uid != os.geteuid():
        raise _refused(path, f"it is owned by uid {info.st_uid}, not by this service's uid {os.geteuid()}")
    if stat.S_IMODE(info.st_mode) != 0o600:
        raise _refused(path, f"its mode is {stat.S_IMODE(info.st_mode):04o}, not 0600")
    if info.st_nlink != 1:
        raise _refused(path, f"it has {info.st_nlink} links, not 1")
    if info.st_size != size:
        raise _refused(path, f"it holds {info.st_size} bytes, not the {size} its handle implies")


def check_header(
    header: SegmentHeader | None, handle: common_pb2.PoolHandle, token: bytes, path: Path
) -> None:
    """InvalidArgument unless the file at path has a header matching the handle's epoch, dtype, shape and
    KV groups and the token given (the segment's, or the fence's)."""
    if header is None:
        raise _refused(path, "it has no pagedserve segment header (magic missing)")
    differ = header.mismatches(handle, token)
    if differ:
        raise _refused(path, f"its header does not match the handle's {', '.join(differ)}")


def _refused(path: Path, reason: str) -> InvalidArgument:
    return InvalidArgument(
        f"refusing pool segment {path}: {reason}; AttachPool maps only the segment the cache service "
        "created: pass the handle its CreatePool returned"
    )
