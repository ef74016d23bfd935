"""Real service processes for tests: started, waited for and stopped with `cli.launch`."""

import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cli.launch import free_port, free_ports, log_tail, spawn, stop, wait_healthy  # noqa: F401 - tests use them

ROOT = Path(__file__).resolve().parent.parent
# `pagedserve` as the console script runs it, without depending on where the script was installed.
PAGEDSERVE = [sys.executable, "-m", "cli"]
# promtool's linter flags the colon of vLLM's metric names (kept: the routers and dashboards made for vLLM
# match them); no other problem is let through.
VLLM_NAME_LINT = re.compile(r"^vllm:\S+ metric names should not contain ':'$")


def start(module: str, *args: str, log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """Starts `python -m module args...` in the repository root (so `tests.*` imports), output to log_path."""
    return spawn([sys.executable, "-m", module, *args], log_path, env, cwd=ROOT)


@contextlib.contextmanager
def socket_dir() -> Iterator[Path]:
    """A new temporary directory (mode 0700) for unix sockets, removed with what is left in it at exit.

    NOTE: under /tmp with a short name: a socket's path holds at most 107 bytes, pytest's tmp_path can be
    longer."""
    path = Path(tempfile.mkdtemp(prefix="ps-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def log_events(path: Path) -> Iterator[dict]:
    """The JSON events of a log file that several processes write (a stack's): a line where two processes'
    writes interleaved still yields each whole event in it; text that is not JSON yields nothing."""
    decoder = json.JSONDecoder()
    for line in Path(path).read_text(errors="replace").splitlines():
        start = line.find("{")
        while start != -1:
            try:
                event, end = decoder.raw_decode(line, start)
            except json.JSONDecodeError:
                start = line.find("{", start + 1)
                continue
            if isinstance(event, dict) and "event" in event:
                yield event
            start = line.find("{", end)


def promtool_problems(exposition: bytes) -> list[str]:
    """What `promtool check metrics` finds wrong with an exposition, but the colon of vLLM's names."""
    argv = ["promtool", "check", "metrics"]
    check = subprocess.run(argv, input=exposition, capture_output=True, timeout=30)
    lines = (check.stdout + check.stderr).decode(errors="replace").splitlines()
    problems = [line for line in lines if not VLLM_NAME_LINT.match(line)]
    # NOTE: exit 3 is lint problems only (all listed); any other failure is a problem in itself.
    return problems if check.returncode in (0, 3) else [*problems, f"promtool exited {check.returncode}"]
