"""The services of a running `pagedserve up`, seen through /proc: which run, by pid, and their memory."""

import os
from pathlib import Path

from compute_service import standby

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


def _launched_by(up_pid: int) -> dict[int, tuple[str, bool]]:
    """The live `python -m MODULE` children of up_pid: each one's module, and whether it is a compute standby
    still waiting (compute_service/standby.py: started with --standby, its name not yet the serving one)."""
    found = {}
    for proc_dir in PROC.glob("[0-9]*"):
        try:
            argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
            comm = (proc_dir / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == up_pid and b"-m" in argv and not gone(int(proc_dir.name)):
            waiting = standby.FLAG.encode() in argv and comm != standby.SERVING
            found[int(proc_dir.name)] = (argv[argv.index(b"-m") + 1].decode(), waiting)
    return found


def services_of(up_pid: int) -> dict[str, int]:
    """The pid of each live service ('cache', 'compute', 'gateway') that the launcher up_pid started; a
    compute standby counts once it serves (took over from the compute before it)."""
    return {
        module.removesuffix("_service"): pid
        for pid, (module, waiting) in _launched_by(up_pid).items()
        if not waiting
    }


def standby_of(up_pid: int) -> tuple[int, bool] | None:
    """The compute standby the launcher up_pid started, if one runs: its pid, and whether it is loaded and
    waiting to take over (False while it still starts)."""
    for pid, (_, waiting) in _launched_by(up_pid).items():
        if waiting:
            try:
                comm = (PROC / str(pid) / "comm").read_text().strip()
            except OSError:
                continue
            return pid, comm == standby.WAITING
    return None


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
