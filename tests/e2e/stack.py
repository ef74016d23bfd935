"""The whole stack (`pagedserve up`) as a real process tree, for end-to-end tests."""

from dataclasses import dataclass
from pathlib import Path

from cli.up import SERVICES
from common.server import channel
from protos import cache_pb2, cache_pb2_grpc, compute_pb2_grpc
from sdk.client import Client
from tests import helpers
from tests.helpers import PAGEDSERVE


@dataclass
class Stack:
    proc: object
    target: str
    cache_target: str
    compute_target: str
    metrics_base: int = 0

    def metrics_url(self, service: str) -> str:
        """The /metrics URL of 'gateway', 'cache' or 'compute' (ports BASE, BASE+1, BASE+2)."""
        return f"http://127.0.0.1:{self.metrics_base + SERVICES.index(service)}/metrics"

    def client(self, timeout: float = 300.0) -> Client:
        return Client(self.target, timeout=timeout)

    def cache(self) -> cache_pb2_grpc.CacheStub:
        return cache_pb2_grpc.CacheStub(channel(self.cache_target))

    def compute(self) -> compute_pb2_grpc.ComputeStub:
        return compute_pb2_grpc.ComputeStub(channel(self.compute_target))

    def stats(self) -> cache_pb2.CacheStats:
        return self.cache().GetStats(cache_pb2.GetStatsRequest(), timeout=10)

    def stop(self) -> int:
        return helpers.stop(self.proc, timeout=60)


def start_stack(log_dir: Path, *args: str) -> Stack:
    """Runs `pagedserve up` on free ports (metrics too) with the given extra flags; waits until it serves."""
    port, cache_port, compute_port = helpers.free_port(), helpers.free_port(), helpers.free_port()
    metrics_base = helpers.free_ports(len(SERVICES))
    log_path = log_dir / f"stack-{port}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = helpers.subprocess.Popen(
        [*PAGEDSERVE, "up", "--port", str(port), "--cache-port", str(cache_port),
         "--compute-port", str(compute_port), "--metrics-port", str(metrics_base), *args],
        cwd=helpers.ROOT, stdout=log, stderr=helpers.subprocess.STDOUT,
    )  # fmt: skip
    proc.log_path = log_path
    stack = Stack(
        proc, f"127.0.0.1:{port}", f"127.0.0.1:{cache_port}", f"127.0.0.1:{compute_port}", metrics_base
    )
    try:
        helpers.wait_healthy(stack.target, proc, timeout=600, service="pagedserve.v1.Generation")
    except BaseException:
        stack.stop()
        raise
    return stack
