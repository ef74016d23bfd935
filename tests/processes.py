"""Processes for tests: whether one still runs and the services a `pagedserve up` started (cli.processes),
the segments a cache left, one process stopped for a while."""

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path

from common.shm_files import files_of

SHM = Path("/dev/shm")


def segments() -> set[Path]:
    return set(SHM.glob("pagedserve-kv-*"))


def segments_of(pid: int) -> set[Path]:
    return set(SHM.glob(f"pagedserve-kv-{pid}-*"))


def left_by(pids: Iterable[int]) -> set[Path]:
    """What these cache processes created in /dev/shm and is still there: pool segments, session fences."""
    return {path for pid in pids for path in files_of(pid, SHM)}


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
