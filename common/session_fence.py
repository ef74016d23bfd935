"""The session fence: which sessions (leases) are open at the cache service, in a small /dev/shm file beside
the pool, which compute checks before every step it runs for a session, with no call to the cache. So a
gateway that stalled past its TTL cannot have compute write into the blocks its lapsed session held, which
the cache may have handed to another gateway by then.

The file holds a header (common/segment_header.py: the pool's epoch, dtype and shape, a token of its own),
then SLOTS slots of 8 bytes, each the epoch of one open session, or 0. Both sides read and write it with
system calls on their own descriptor, and meet on POSIX byte-range locks of a slot, which the kernel orders
and which end with the process that held them:
- the cache, opening a session, writes its epoch into a free slot;
- compute, to run a step of the session with epoch e, finds e's slot, takes a shared lock on it and reads
  it again: still e, it runs the step, then unlocks; else it refuses the step, having written nothing;
- the cache, ending a session (a lapse, a close), zeroes its slot, then tries an exclusive lock on it: if
  it gets it, no step of the session runs or will, and the session's blocks are freed; if not, a step runs,
  and they are freed at a later sweep, once the lock can be had.
"""

import fcntl
import os
import struct
import uuid
from pathlib import Path

import numpy as np

from common import segment_header, shared_pool
from common.segment_header import HEADER_BYTES, SegmentHeader
from common.shm_files import FENCE_PREFIX, SHM_DIR
from protos import common_pb2

SLOTS = 4096
SLOT = struct.Struct("<Q")
FILE_BYTES = HEADER_BYTES + SLOTS * SLOT.size


def _offset(slot: int) -> int:
    assert 0 <= slot < SLOTS, slot
    return HEADER_BYTES + slot * SLOT.size


class SessionFence:
    """One side's open fence file."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def create(cls, handle: common_pb2.PoolHandle, shm_dir: Path = SHM_DIR) -> "SessionFence":
        """The cache's new fence for the pool of `handle` (every slot free), named in handle.fence."""
        token = segment_header.new_token()
        path = shm_dir / f"{FENCE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            shared_pool.reserve(fd, FILE_BYTES, shm_dir)
            segment_header.write(fd, 0, SegmentHeader.of(handle, token))
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        handle.fence.CopyFrom(common_pb2.SharedMemoryHandle(path=str(path), nbytes=FILE_BYTES, token=token))
        return cls(fd, path)

    @classmethod
    def open(cls, handle: common_pb2.PoolHandle, shm_dir: Path = SHM_DIR) -> "SessionFence":
        """Compute's view of the fence handle.fence names, once the file passes the checks a segment does
        (shared_pool.open_file) and its header matches the handle and the fence's token."""
        path = Path(handle.fence.path)
        fd = shared_pool.open_file(path, FENCE_PREFIX, FILE_BYTES, shm_dir)
        try:
            shared_pool.check_header(segment_header.read(fd, 0), handle, handle.fence.token, path)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    # the cache's side

    def publish(self, slot: int, epoch: int) -> None:
        assert epoch > 0, epoch
        os.pwrite(self.fd, SLOT.pack(epoch), _offset(slot))

    def end(self, slot: int) -> bool:
        """Zeroes the slot; returns whether no step holds it (see `quiet`)."""
        os.pwrite(self.fd, SLOT.pack(0), _offset(slot))
        return self.quiet(slot)

    def quiet(self, slot: int) -> bool:
        """Whether no compute holds the slot now: its exclusive lock, taken and let go at once."""
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, SLOT.size, _offset(slot))
        except OSError:
            return False
        fcntl.lockf(self.fd, fcntl.LOCK_UN, SLOT.size, _offset(slot))
        return True

    # compute's side

    def slot_of(self, epoch: int) -> int | None:
        """The slot holding epoch now, if any."""
        table = np.frombuffer(os.pread(self.fd, SLOTS * SLOT.size, HEADER_BYTES), dtype="<u8")
        found = np.flatnonzero(table == epoch)
        return int(found[0]) if found.size else None

    def hold(self, slot: int, epoch: int) -> bool:
        """Takes the slot's shared lock and returns True while it holds epoch; else lets it go, False."""
        fcntl.lockf(self.fd, fcntl.LOCK_SH, SLOT.size, _offset(slot))
        if self.holds(slot, epoch):
            return True
        self.release(slot)
        return False

    def holds(self, slot: int, epoch: int) -> bool:
        return SLOT.unpack(os.pread(self.fd, SLOT.size, _offset(slot)))[0] == epoch

    def release(self, slot: int) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN, SLOT.size, _offset(slot))

    def close(self) -> None:
        os.close(self.fd)
