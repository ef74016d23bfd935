"""What starting the stack costs: `pagedserve up` (with the flags given after `--`) until it prints its ready
line, and the CPU seconds (user + system, reaped children included) that the launcher and each service spent
by then; then until compute's warm standby (started once the stack is ready; not with --no-compute-standby)
is loaded, its wall time from the ready line, its CPU seconds and the resident memory (private, and mapped
from files) of compute and the standby; and `pagedserve --help`, its wall and CPU seconds. Each is run --runs
times and the median printed: CPU seconds hold on a busy machine, wall seconds do not. With --compute, only
the compute service (the default model, on a unix socket) until it serves: its CPU seconds and wall.

    .venv/bin/python -m scripts.startup_cost --runs 3 [--compute] [-- up flags...]
"""

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cli.launch import free_port, log_tail, spawn, stop
from cli.processes import PROC, services_of, standby_of
from common.healthcheck import serving

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("cache", "compute", "gateway")
READY = "pagedserve ready on"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system seconds of process pid and of the children it reaped."""
    fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15]) / TICKS


def up_once(flags: list[str], timeout: float) -> dict[str, float]:
    """One `pagedserve up` until ready: CPU seconds of the launcher and of each service, and the wall time."""
    sockets = Path(tempfile.mkdtemp(prefix="ps-"))
    log = sockets / "up.log"
    argv = [sys.executable, "-m", "cli", "up", "--port", str(free_port()), "--http-port", str(free_port()),
            "--runtime-dir", str(sockets), *flags]  # fmt: skip
    began = time.monotonic()
    proc = spawn(argv, log, cwd=ROOT)
    try:
        while READY not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() - began > timeout:
                raise RuntimeError(f"pagedserve up did not get ready:\n{log_tail(proc)}")
            time.sleep(0.1)
        wall = time.monotonic() - began
        cost = {"launcher": cpu_seconds(proc.pid)}
        cost.update({name: cpu_seconds(pid) for name, pid in sorted(services_of(proc.pid).items())})
        if "--no-compute-standby" not in flags:
            cost.update(standby_loaded(proc, began + wall, timeout))
    finally:
        code = stop(proc, timeout=60)
        shutil.rmtree(sockets, ignore_errors=True)
    assert code == 0, f"pagedserve up exited with {code}:\n{log_tail(proc)}"
    cost["total"] = sum(value for key, value in cost.items() if key in ("launcher", *SERVICES))
    return {**cost, "wall": wall}


def standby_loaded(proc: subprocess.Popen, ready_at: float, timeout: float) -> dict[str, float]:
    """Once the standby of `pagedserve up` (proc) is loaded: the wall seconds from ready_at, its CPU seconds,
    and the resident MiB of compute and the standby (RssAnon: private; RssFile: mapped from files)."""
    while (found := standby_of(proc.pid)) is None or not found[1]:
        if proc.poll() is not None or time.monotonic() - ready_at > timeout:
            raise RuntimeError(f"no compute standby loaded:\n{log_tail(proc)}")
        time.sleep(0.05)
    figures = {"standby_wall": time.monotonic() - ready_at, "standby": cpu_seconds(found[0])}
    for name, pid in (("compute", services_of(proc.pid)["compute"]), ("standby", found[0])):
        status = dict(line.split(":", 1) for line in (PROC / str(pid) / "status").read_text().splitlines())
        for field in ("RssAnon", "RssFile"):
            figures[f"{name}_{field}_MiB"] = int(status[field].split()[0]) / 1024
    return figures


def compute_once(flags: list[str], timeout: float) -> dict[str, float]:
    """`python -m compute_service` (with `flags`) until it serves: its CPU seconds and the wall time."""
    sockets = Path(tempfile.mkdtemp(prefix="ps-"))
    socket = sockets / "compute.sock"
    argv = [sys.executable, "-m", "compute_service", "--socket", str(socket), *flags]
    began = time.monotonic()
    proc = spawn(argv, sockets / "compute.log", cwd=ROOT)
    try:
        while not (socket.exists() and serving(f"unix:{socket}")):
            if proc.poll() is not None or time.monotonic() - began > timeout:
                raise RuntimeError(f"compute did not serve:\n{log_tail(proc)}")
            time.sleep(0.05)
        wall = time.monotonic() - began
        cost = {"compute": cpu_seconds(proc.pid)}
    finally:
        stop(proc, timeout=60)
        shutil.rmtree(sockets, ignore_errors=True)
    return {**cost, "wall": wall}


def help_once() -> dict[str, float]:
    """`pagedserve --help`: its wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "cli", "--help"], cwd=ROOT, check=True, capture_output=True)
    wall = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": wall, "cpu": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime}


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    parser.add_argument("--compute", action="store_true", help="the compute service alone, until it serves")
    parser.add_argument("flags", nargs="*", help="flags for pagedserve up, or compute (after --)")
    args = parser.parse_args()
    if args.compute:
        starts = []
        for run in range(args.runs):
            starts.append(compute_once(args.flags, args.timeout))
            print(f"compute run {run + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in starts[-1].items()))
        print(f"compute until it serves (median of {args.runs}): " + ", ".join(
            f"{key} {value:.2f}" for key, value in medians(starts).items()))  # fmt: skip
        return
    helps = [help_once() for _ in range(args.runs)]
    ups = []
    for run in range(args.runs):
        ups.append(up_once(args.flags, args.timeout))
        print(f"up run {run + 1}: " + ", ".join(f"{key} {value:.2f}" for key, value in ups[-1].items()))
    print(f"pagedserve --help (median of {args.runs}): " + ", ".join(
        f"{key} {value:.2f}s" for key, value in medians(helps).items()))  # fmt: skip
    print(f"pagedserve up until ready (median of {args.runs}): " + ", ".join(
        f"{key} {value:.2f}" for key, value in medians(ups).items()))  # fmt: skip


if __name__ == "__main__":
    main()
