"""The image store's file: a /dev/shm file beside the pool (a header page, common/segment_header.py, with the
pool's epoch, dtype and shape and a token of its own, then the data) in which the cache service leases byte
ranges (cache_service/image_store.py) and compute writes and reads image embeddings in place. Its handle is
PoolHandle.image_store; compute maps it only once the file passes the checks a pool segment does."""

import mmap
import os
import uuid
from pathlib import Path

import torch

from common import segment_header, shared_pool
from common.segment_header import HEADER_BYTES, SegmentHeader
from common.shm_files import IMAGES_PREFIX, SHM_DIR
from protos import common_pb2


def create(handle: common_pb2.PoolHandle, nbytes: int, shm_dir: Path = SHM_DIR) -> None:
    """A new zeroed, fully backed store of `nbytes` data bytes for the pool of `handle`, named in
    handle.image_store; ResourceExhausted if shm_dir cannot hold it. The caller removes it
    (shared_pool.release)."""
    token = segment_header.new_token()
    path = shm_dir / f"{IMAGES_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        shared_pool.reserve(fd, HEADER_BYTES + nbytes, shm_dir)
        segment_header.write(fd, 0, SegmentHeader.of(handle, token))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    handle.image_store.CopyFrom(common_pb2.SharedMemoryHandle(path=str(path), nbytes=nbytes, token=token))


def open_store(handle: common_pb2.PoolHandle, shm_dir: Path = SHM_DIR) -> torch.Tensor:
    """The store's data as a uint8 tensor over a shared mapping, once the file handle.image_store names is
    one the cache created for this pool (shared_pool.open_file's checks, the header's epoch, shape and
    token). InvalidArgument, or FailedPrecondition if it is gone; a refusal maps nothing."""
    store = handle.image_store
    path = Path(store.path)
    fd = shared_pool.open_file(path, IMAGES_PREFIX, HEADER_BYTES + store.nbytes, shm_dir)
    try:
        shared_pool.check_header(segment_header.read(fd, 0), handle, store.token, path)
        mapping = mmap.mmap(
            fd,
            store.nbytes,
            flags=mmap.MAP_SHARED | shared_pool.POPULATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=HEADER_BYTES,
        )
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)
