"""Cache, compute and gateway started directly (cache and compute on unix sockets), for the KV tiers' e2e
tests: the cache alone can be restarted with other tier flags."""

import signal
import subprocess
from pathlib import Path

from common.server import channel
from protos import cache_pb2, cache_pb2_grpc
from sdk.client import Client
from tests.helpers import start, wait_healthy

GATEWAY_SERVICE = "pagedserve.v1.Generation"
BLOCK_SIZE = 16
GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


class Stack:
    """Cache, compute and gateway started directly, cache and compute on unix sockets; the cache alone is
    restarted (the gateway re-handshakes on its own, docs/operations.md)."""

    def __init__(self, model: Path, sockets: Path, logs: Path) -> None:
        self.model, self.sockets, self.logs = model, sockets, logs
        self.caches: list[subprocess.Popen] = []
        self.cache_target = f"unix:{sockets / 'cache.sock'}"
        self.compute_target = f"unix:{sockets / 'compute.sock'}"
        self.gateway_target = ""
        self.procs: list[subprocess.Popen] = []

    def _start(self, module: str, name: str, target: str, *argv: str, service: str = "") -> subprocess.Popen:
        proc = start(module, *argv, log_path=self.logs / f"{name}-{len(self.procs)}.log")
        self.procs.append(proc)
        wait_healthy(target, proc, 120, service)
        return proc

    def start_cache(self, *argv: str) -> None:
        socket = self.cache_target.removeprefix("unix:")
        argv = ("--socket", socket, "--kv-blocks", "256", "--log-format", "json", *argv)
        self.caches.append(self._start("cache_service", "cache", self.cache_target, *argv))

    def stop_cache(self, sig: signal.Signals = signal.SIGTERM) -> None:
        proc = self.caches[-1]
        proc.send_signal(sig)
        proc.wait(30)

    def start_rest(self, port: int, *gateway_argv: str) -> None:
        socket = self.compute_target.removeprefix("unix:")
        self._start("compute_service", "compute", self.compute_target, "--socket", socket, "--model",
                    str(self.model), "--dtype", "float32", "--threads", "1")  # fmt: skip
        self.gateway_target = f"127.0.0.1:{port}"
        argv = ("--port", str(port), "--model", str(self.model), "--block-size", str(BLOCK_SIZE),
                "--cache-target", self.cache_target,
                "--compute-target", self.compute_target, *gateway_argv)  # fmt: skip
        self._start("gateway", "gateway", self.gateway_target, *argv, service=GATEWAY_SERVICE)

    def generate(self, prompt: list[int]):
        """A greedy completion, once the gateway serves again (after a cache restart)."""
        wait_healthy(self.gateway_target, self.procs[-1], 60, GATEWAY_SERVICE)
        with Client(self.gateway_target, timeout=120) as client:
            return client.generate(token_ids=prompt, **GREEDY)

    def tier(self) -> cache_pb2.TierStats:
        with channel(self.cache_target) as ch:
            return cache_pb2_grpc.CacheStub(ch).GetStats(cache_pb2.GetStatsRequest(), timeout=10).kv_tier
