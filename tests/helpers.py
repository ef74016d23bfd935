"""Starting real service processes for tests and waiting until they report healthy."""

import os
import subprocess
import sys
import time
from pathlib import Path

from cli.launch import free_port, free_ports, serving  # noqa: F401 - the tests use them from here

ROOT = Path(__file__).resolve().parent.parent
# `pagedserve` as the console script runs it, without depending on where the script was installed.
PAGEDSERVE = [sys.executable, "-m", "cli"]


def start(module: str, *args: str, log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """Starts `python -m module args...` in its own process, output to log_path."""
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    proc.log_path = log_path
    return proc


def log_tail(proc: subprocess.Popen, lines: int = 40) -> str:
    return "\n".join(Path(proc.log_path).read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(target: str, proc: subprocess.Popen, timeout: float = 300.0, service: str = "") -> None:
    """Polls grpc.health.v1 until SERVING; fails with the log tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{target} exited with {proc.returncode}:\n{log_tail(proc)}")
        if serving(target, service):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{target} not healthy after {timeout}s:\n{log_tail(proc)}")


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM, then SIGKILL if it does not exit; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
