"""Starting a whole stack (`pagedserve up`) on free ports from another program, and waiting for it."""

import contextlib
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

GATEWAY_SERVICE = "pagedserve.v1.Generation"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports."""
    while True:
        base = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


def serving(target: str, service: str = "") -> bool:
    """One health check: True when the server at target reports SERVING for service."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@dataclass
class Stack:
    proc: subprocess.Popen
    target: str
    cache_target: str
    compute_target: str
    # The gateway's Prometheus endpoint (cache and compute on the next two ports).
    metrics_url: str

    @classmethod
    def start(cls, model: str, dtype: str, block_size: int, *flags: str, timeout: float = 900.0) -> "Stack":
        """`pagedserve up` with these settings on free ports; returns once the gateway serves."""
        port, cache_port, compute_port, metrics = free_port(), free_port(), free_port(), free_ports(3)
        cmd = [sys.executable, "-m", "cli", "up", "--model", model, "--dtype", dtype,
               "--block-size", str(block_size), "--port", str(port), "--cache-port", str(cache_port),
               "--compute-port", str(compute_port), "--metrics-port", str(metrics), "--log-format", "json",
               *flags]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack = cls(
            proc, f"127.0.0.1:{port}", f"127.0.0.1:{cache_port}", f"127.0.0.1:{compute_port}",
            f"http://127.0.0.1:{metrics}/metrics",
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not serving(stack.target, GATEWAY_SERVICE):
            if proc.poll() is not None or time.monotonic() > deadline:
                stack.stop()
                raise RuntimeError(f"the stack did not start: {' '.join(cmd)}")
            time.sleep(0.5)
        return stack

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
