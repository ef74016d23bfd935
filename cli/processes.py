"""The services of a running `pagedserve up`, seen through /proc: which run, by pid, and their memory."""

import os
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK")


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet: it runs no more."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def cpu_seconds(pid: int) -> float:
    """User + system seconds process pid has spent so far (its own threads; 0 once it is gone)."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is pid."""
    found = []
    for proc_dir in PROC.glob("[0-9]*"):
        try:
            ppid = int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and not gone(int(proc_dir.name)):
            found.append(int(proc_dir.name))
    return found


def services_of(up_pid: int) -> dict[str, int]:
    """The pid of each live service ('cache', 'compute', 'gateway') that the launcher up_pid started."""
    found = {}
    for proc_dir in PROC.glob("[0-9]*"):
        try:
            argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == up_pid and b"-m" in argv and not gone(int(proc_dir.name)):
            module = argv[argv.index(b"-m") + 1].decode()
            found[module.removesuffix("_service")] = int(proc_dir.name)
    return found


def rss_bytes(pid: int) -> int | None:
    """The resident memory of process pid (VmRSS), None once it is gone."""
    try:
        status = (PROC / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None
