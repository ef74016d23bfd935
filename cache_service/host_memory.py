"""What the host can back: a pool is refused before anything is allocated unless its segment fits the shm
filesystem's free space and the segment plus the block bookkeeping fit the share of available memory a pool
may take. Without this check a huge CreatePool grows the cache until the kernel's OOM killer ends it."""

import os
from dataclasses import dataclass
from pathlib import Path

from common.errors import ResourceExhausted
from common.segment_header import HEADER_BYTES
from common.shm_files import SHM_DIR

# The share of available memory one pool may take; the rest is left to the host and the other services.
MEMORY_SHARE = 0.9
# A bound on the cache's own memory per block (refcounts, the allocator's state; freelist ~50 bytes).
BOOKKEEPING_BYTES_PER_BLOCK = 64
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class HostRoom:
    """Bytes the host can still back: free space on the shm filesystem, and available physical memory."""

    shm_free: int
    memory_available: int

    @classmethod
    def probe(cls, shm_dir: Path) -> "HostRoom":
        fs = os.statvfs(shm_dir)
        return cls(fs.f_bavail * fs.f_frsize, memory_available())


def memory_available() -> int:
    """MemAvailable from /proc/meminfo (free pages if it cannot be read), or less where the cgroup's memory
    limit leaves less."""
    try:
        available = _meminfo_available(MEMINFO.read_text())
    except (OSError, ValueError):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(available, _cgroup_room(CGROUP))


def _meminfo_available(text: str) -> int:
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, unit = value.split()
            assert unit == "kB", unit
            return int(number) * 1024
    raise ValueError("no MemAvailable in /proc/meminfo")


def _cgroup_room(cgroup: Path) -> int | float:
    """Bytes left under a cgroup v2 memory limit; infinite without one."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = int((cgroup / "memory.current").read_text())
    except (OSError, ValueError):
        return float("inf")
    return float("inf") if limit == "max" else max(int(limit) - used, 0)


def require_room_here(pool_bytes: int, num_blocks: int, shm_dir: Path = SHM_DIR) -> None:
    """`require_room` with this host's numbers now."""
    require_room(pool_bytes, num_blocks, HostRoom.probe(shm_dir), shm_dir)


def require_room(pool_bytes: int, num_blocks: int, room: HostRoom, shm_dir: Path) -> None:
    """ResourceExhausted, naming the numbers, unless the host can back a pool of pool_bytes in num_blocks
    blocks (0 when not known yet: a --kv-memory default before the geometry is)."""
    segment = pool_bytes + HEADER_BYTES
    memory = segment + num_blocks * BOOKKEEPING_BYTES_PER_BLOCK
    if segment <= room.shm_free and memory <= room.memory_available * MEMORY_SHARE:
        return
    raise ResourceExhausted(
        f"a pool of {_size(pool_bytes)} does not fit this host: it needs {_size(segment)} of shared memory "
        f"and {_size(memory)} of memory with its bookkeeping; {shm_dir} has {_size(room.shm_free)} free and "
        f"{_size(room.memory_available)} of memory is available (MemAvailable; a pool may take "
        f"{MEMORY_SHARE:.0%} of it): give a smaller memory_bytes/num_blocks (--kv-memory/--kv-blocks), or "
        "free memory or enlarge the shared memory (docker: shm_size)"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**30:.2f} GiB)"
