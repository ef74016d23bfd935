"""Servers as child processes on free ports: started, waited for until they serve, stopped.

`Stack` is a whole `pagedserve up` (for the bench and the end-to-end tests); `spawn` and `wait_healthy`
start and wait for any one server.
"""

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from cli import runtime_dir
from cli.metrics_ports import SERVICES, metrics_port
from cli.up import START_TIMEOUT_S
from common.healthcheck import serving
from common.server import channel
from protos import cache_pb2, cache_pb2_grpc, compute_pb2_grpc, generation_pb2
from sdk.client import Client

GATEWAY_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


# NOTE: ports handed out come from below the kernel's ephemeral range. A port the kernel picked (bind to 0)
# and we released goes back to that range, where the next outgoing connection (a health probe, a gRPC
# client, another stack's services) may be given it in the seconds before the server it was meant for binds
# it: a fresh-clone run lost a compute metrics port that way, five restarts in a row.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000
_handed_out: set[int] = set()


def _candidate_ports() -> range:
    """The ports below the ephemeral range (all unprivileged ones if that leaves too few)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    below = range(LOWEST_PORT, low)
    return below if len(below) >= 1000 else range(1024, 65536)


def free_port() -> int:
    return free_ports(1)


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1 now, outside the ephemeral range and not
    handed out before by this process."""
    ports = _candidate_ports()
    while True:
        base = random.randrange(ports.start, ports.stop - count + 1)
        wanted = range(base, base + count)
        if not _handed_out.isdisjoint(wanted):
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in wanted:
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.update(wanted)
        return base


def spawn(
    argv: list[str], log_path: Path | None = None, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """Starts argv in cwd with stdout and stderr in log_path (discarded when None), env added to this
    environment; the process's `log_path` names its log."""
    with open(log_path, "w") if log_path else contextlib.nullcontext(subprocess.DEVNULL) as log:
        proc = subprocess.Popen(
            argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    proc.log_path = log_path
    return proc


def log_tail(proc: subprocess.Popen, lines: int = 40) -> str:
    if proc.log_path is None:
        return f"(output discarded) {' '.join(map(str, proc.args))}"
    return "\n".join(Path(proc.log_path).read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(
    target: str,
    proc: subprocess.Popen,
    timeout: float = 300.0,
    service: str = "",
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Returns once target answers SERVING for service (asked with credentials, if given); RuntimeError if
    proc exits first, TimeoutError when time runs out (proc left running), both with the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{target} exited with {proc.returncode}:\n{log_tail(proc)}")
        if serving(target, service, credentials=credentials):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{target} not healthy after {timeout}s:\n{log_tail(proc)}")


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM, then SIGKILL if it does not exit within timeout; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@dataclass
class Stack:
    """A running `pagedserve up`: its process, its services' addresses (cache and compute: unix sockets in
    its own runtime directory), stubs and /metrics URLs."""

    proc: subprocess.Popen
    target: str
    cache_target: str
    compute_target: str
    metrics_base: int
    runtime_dir: Path
    # The OpenAI-compatible HTTP API's base URL (http://127.0.0.1:PORT/v1).
    http_url: str

    @classmethod
    def start(
        cls,
        *flags: str,
        log_dir: Path | None = None,
        cwd: Path | None = None,
        timeout: float = START_TIMEOUT_S,
    ) -> "Stack":
        """`pagedserve up` with these flags in cwd on a free port, HTTP and metrics on free ports too, the
        sockets in a new temporary runtime directory, its output in log_dir/stack-PORT.log (discarded
        without log_dir); returns once the gateway serves."""
        port, http_port, metrics_base = free_port(), free_port(), free_ports(len(SERVICES))
        # NOTE: a short path: a unix socket's path holds at most 107 bytes.
        sockets = Path(tempfile.mkdtemp(prefix="ps-"))
        argv = [sys.executable, "-m", "cli", "up", "--port", str(port), "--runtime-dir", str(sockets),
                "--http-port", str(http_port), "--metrics-port", str(metrics_base), *flags]  # fmt: skip
        proc = spawn(argv, log_dir / f"stack-{port}.log" if log_dir else None, cwd=cwd)
        cache, compute = (f"unix:{runtime_dir.socket_path(sockets, name)}" for name in ("cache", "compute"))
        http_url = f"http://127.0.0.1:{http_port}/v1"
        stack = cls(proc, f"127.0.0.1:{port}", cache, compute, metrics_base, sockets, http_url)
        try:
            wait_healthy(stack.target, proc, timeout, GATEWAY_SERVICE)
        except BaseException:
            stack.stop()
            raise
        return stack

    def metrics_url(self, service: str = "gateway") -> str:
        """The /metrics URL of 'gateway', 'cache' or 'compute' (ports BASE, BASE+1, BASE+2)."""
        return f"http://127.0.0.1:{metrics_port(self.metrics_base, service)}/metrics"

    def client(self, timeout: float = 300.0) -> Client:
        return Client(self.target, timeout=timeout)

    def cache(self) -> cache_pb2_grpc.CacheStub:
        return cache_pb2_grpc.CacheStub(channel(self.cache_target))

    def compute(self) -> compute_pb2_grpc.ComputeStub:
        return compute_pb2_grpc.ComputeStub(channel(self.compute_target))

    def stats(self) -> cache_pb2.CacheStats:
        return self.cache().GetStats(cache_pb2.GetStatsRequest(), timeout=10)

    def stop(self) -> int:
        code = stop(self.proc, timeout=60)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return code
