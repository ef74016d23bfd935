"""Real service processes for tests: started, waited for and stopped with `cli.launch`."""

import subprocess
import sys
from pathlib import Path

from cli.launch import free_port, free_ports, log_tail, spawn, stop, wait_healthy  # noqa: F401 - tests use them

ROOT = Path(__file__).resolve().parent.parent
# `pagedserve` as the console script runs it, without depending on where the script was installed.
PAGEDSERVE = [sys.executable, "-m", "cli"]


def start(module: str, *args: str, log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """Starts `python -m module args...` in the repository root (so `tests.*` imports), output to log_path."""
    return spawn([sys.executable, "-m", module, *args], log_path, env, cwd=ROOT)
