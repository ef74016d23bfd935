"""Processes seen through /proc: whether one still runs, and the services a `pagedserve up` started; one
stopped for a while."""

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path

SHM = Path("/dev/shm")


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet: it runs no more."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def services_of(up_pid: int) -> dict[str, int]:
    """The pid of each live service ('cache', 'compute', 'gateway') that the launcher up_pid started."""
    found = {}
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == up_pid and b"-m" in argv and not gone(int(proc_dir.name)):
            module = argv[argv.index(b"-m") + 1].decode()
            found[module.removesuffix("_service")] = int(proc_dir.name)
    return found


def segments() -> set[Path]:
    return set(SHM.glob("pagedserve-kv-*"))


def segments_of(pid: int) -> set[Path]:
    return set(SHM.glob(f"pagedserve-kv-{pid}-*"))


def left_by(pids: Iterable[int]) -> set[Path]:
    """What these cache processes created in /dev/shm and is still there: pool segments, session fences."""
    return {
        path for pid in pids for kind in ("kv", "fence") for path in SHM.glob(f"pagedserve-{kind}-{pid}-*")
    }


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """pid stopped (SIGSTOP) inside the block and continued (SIGCONT) when it is left, also on an error; a
    process gone meanwhile is not an error."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
