"""Chaos with real processes (cache, compute and gateway apart, the real model): 32 streaming requests, greedy
and seeded sampling, while compute, the cache and the gateway are killed (SIGKILL) and started again on their
ports, each twice, at seeded random moments; and a cache stopped and started again with another allocator
under load.

Every request ends with exactly the tokens of a fault-free run: a lost cache or compute is recomputed by the
gateway, and a stream whose gateway died (UNAVAILABLE) is resumed by the SDK on the gateway started again
on its port (GenerateRequest.resume). Afterwards no block is used, no sequence or stray /dev/shm segment is
left, and the stack serves a new request."""

import json
import random
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from cli.launch import GATEWAY_SERVICE
from common.healthcheck import status
from common.server import channel
from protos import cache_pb2, cache_pb2_grpc
from sdk.client import Client, GenerationError
from tests.helpers import free_port, start, stop, wait_healthy
from tests.processes import segments_of

pytestmark = pytest.mark.e2e
SEED, TTL_S, WAIT_S = 1212, 2, 60
FAULTS = ["compute", "cache", "gateway", "compute", "cache", "gateway"]
WAVES = [6, 6, 5, 5, 5, 5]  # requests submitted before each fault: 32 in all
SUBJECTS = ["lighthouse", "river", "violin", "glacier", "market", "comet", "orchard", "library"]
OPENINGS = ["Tell me about the", "Write a short poem about a", "Three facts about the",
            "Once upon a time, near an old"]  # fmt: skip
PROMPTS = [f"{opening} {subject}" for opening in OPENINGS for subject in SUBJECTS]
MODULES = {"cache": "cache_service", "compute": "compute_service", "gateway": "gateway"}


class Services:
    """Cache, compute and gateway processes, each on its own port for good: killed and started again there."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.ports = {name: free_port() for name in MODULES}
        self.targets = {name: f"127.0.0.1:{port}" for name, port in self.ports.items()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.history: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, *args: str) -> None:
        argv = {
            "cache": ["--kv-blocks", "512", "--max-session-ttl", "30", "--insecure"],
            "compute": ["--model", "smollm2", "--dtype", "float32", "--insecure"],
            "gateway": ["--model", "smollm2", "--cache-target", self.targets["cache"], "--log-format", "json",
                        "--compute-target", self.targets["compute"], "--session-ttl", str(TTL_S)],
        }[name]  # fmt: skip
        log_path = self.logs / f"{name}-{len(self.history)}.log"
        proc = start(MODULES[name], *argv, "--port", str(self.ports[name]), *args, log_path=log_path)
        self.procs[name] = proc
        self.history.append((name, proc))
        wait_healthy(self.targets[name], proc, 120, GATEWAY_SERVICE if name == "gateway" else "")

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def wait_serving(self) -> None:
        """Until the gateway answers SERVING (its peers attached), at most WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while status(self.targets["gateway"], GATEWAY_SERVICE) != "SERVING":
            assert time.monotonic() < deadline, "the gateway did not serve again"
            time.sleep(0.2)

    def cache_stats(self) -> cache_pb2.CacheStats:
        with channel(self.targets["cache"]) as chan:
            return cache_pb2_grpc.CacheStub(chan).GetStats(cache_pb2.GetStatsRequest(), timeout=10)

    def wait_released(self) -> cache_pb2.CacheStats:
        """Until no block is used and no sequence held (a killed gateway's session lapses), at most WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while (stats := self.cache_stats()).used_blocks or stats.num_sequences:
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        return stats

    def cache_pids(self) -> list[int]:
        return [proc.pid for name, proc in self.history if name == "cache"]

    def stray_segments(self) -> list[Path]:
        """The segments of this test's caches but the live one's own."""
        live = self.procs["cache"].pid
        return sorted(path for pid in self.cache_pids() if pid != live for path in segments_of(pid))


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    svc = Services(tmp_path_factory.mktemp("chaos-logs"))
    try:
        for name in MODULES:
            svc.start(name)
        yield svc
    finally:
        for name in ["gateway", "compute", "cache"]:
            if name in svc.procs:
                stop(svc.procs[name])
        for _, proc in svc.history:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    leftover = [path for pid in svc.cache_pids() for path in segments_of(pid)]
    assert leftover == [], "a segment was left in /dev/shm"


def sampling(index: int) -> dict:
    """Request `index`'s sampling: greedy for even ones, seeded sampling for odd ones."""
    if index % 2 == 0:
        return {"temperature": 0.0}
    return {"temperature": 0.8, "top_p": 0.95, "seed": SEED + index}


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""
    # How often its stream broke and was resumed.
    resumes: int = 0


class Streams:
    """Streaming requests in threads; counts the tokens streamed so far, over all of them."""

    def __init__(self, target: str, salt: str) -> None:
        self.target, self.salt = target, salt
        self.streamed = 0
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(len(PROMPTS))

    def submit(self, index: int) -> Future:
        return self.pool.submit(self.run, index)

    def run(self, index: int) -> Outcome:
        outcome = Outcome()
        try:
            with Client(self.target, timeout=WAIT_S * 3) as client:
                for chunk in client.stream(prompt=PROMPTS[index], max_tokens=24 + index % 25, ignore_eos=True,
                                           cache_salt=self.salt, **sampling(index)):  # fmt: skip
                    outcome.tokens += chunk.token_ids
                    outcome.resumes = chunk.resumes
                    with self.lock:
                        self.streamed += len(chunk.token_ids)
        except GenerationError as err:
            outcome.code, outcome.details = err.code, err.details
        return outcome

    def wait_streamed(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.streamed < count:
            assert time.monotonic() < deadline, f"only {self.streamed} of {count} tokens streamed"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def expected(services) -> list[list[int]]:
    """Every prompt's tokens on the stack before any fault, all streaming at once: the fault-free run both
    tests compare with (a request's tokens do not depend on the batch it runs in, nor on its cache salt)."""
    streams = Streams(services.targets["gateway"], "reference")
    with streams.pool:
        outcomes = [future.result(WAIT_S * 3) for future in map(streams.submit, range(len(PROMPTS)))]
    assert all(outcome.code is None for outcome in outcomes), [o.details for o in outcomes if o.code]
    return [outcome.tokens for outcome in outcomes]


def inject(services: Services, name: str) -> None:
    """kill -9 the service and start a new one on its port (a new gateway on the same cache and compute)."""
    services.kill(name)
    services.start(name)
    services.wait_serving()


def test_kill_compute_cache_and_gateway_twice_each_under_32_streams(services, expected, tmp_path):
    rng, streams = random.Random(SEED), Streams(services.targets["gateway"], "chaos")
    jobs: list[tuple[int, Future]] = []
    in_flight, started = [], time.monotonic()
    with streams.pool:
        for fault, wave in zip(FAULTS, WAVES, strict=True):
            first = len(jobs)
            jobs += [(index, streams.submit(index)) for index in range(first, first + wave)]
            streams.wait_streamed(streams.streamed + rng.randint(1, 10 * wave))
            in_flight.append(sum(not future.done() for _, future in jobs))
            inject(services, fault)
        outcomes = [(index, future.result(WAIT_S * 3)) for index, future in jobs]
    identical = [
        index for index, outcome in outcomes if outcome.code is None and outcome.tokens == expected[index]
    ]
    resumed = [index for index, outcome in outcomes if outcome.resumes]
    stats = services.wait_released()
    stray = services.stray_segments()
    with Client(services.targets["gateway"], timeout=WAIT_S) as client:
        after = client.generate(
            prompt=PROMPTS[0], max_tokens=24, temperature=0.0, ignore_eos=True, cache_salt="after"
        )
    figures = {
        "faults_injected": len(FAULTS), "requests": len(outcomes),
        "requests_completed_identical": len(identical), "requests_resumed": len(resumed),
        "in_flight_at_each_fault": in_flight, "blocks_leaked": stats.used_blocks,
        "sequences_left": stats.num_sequences, "stray_segments": len(stray),
        "seconds": round(time.monotonic() - started, 1),
    }  # fmt: skip
    print("chaos:", json.dumps(figures), "in", tmp_path / "chaos.json")
    (tmp_path / "chaos.json").write_text(json.dumps(figures, indent=2))
    wrong = {
        index: (o.code, o.details, o.tokens, expected[index])
        for index, o in outcomes
        if index not in identical
    }
    assert wrong == {}, "a request did not complete with the fault-free run's tokens"
    assert len(identical) == len(PROMPTS)
    assert all(count > 0 for count in in_flight), f"a fault hit no request in flight: {in_flight}"
    assert resumed, "the gateway kills broke streams, which were resumed"
    assert (stats.used_blocks, stats.num_sequences, stray) == (0, 0, [])
    assert after.token_ids == expected[0][:24]


def test_a_cache_restarted_with_another_allocator_under_load_changes_no_token(services, expected):
    streams = Streams(services.targets["gateway"], "swap")
    with streams.pool:
        futures = [streams.submit(index) for index in range(8)]
        streams.wait_streamed(8)
        assert not all(future.done() for future in futures), "the swap hit no request in flight"
        assert stop(services.procs["cache"]) == 0  # SIGTERM: the cache unlinks its segment
        services.start("cache", "--allocator", "bitmap")
        outcomes = [future.result(WAIT_S * 3) for future in futures]
    assert [outcome.tokens for outcome in outcomes] == expected[:8], [o.details for o in outcomes]
    stats = services.wait_released()
    assert stats.allocator == "bitmap"
    assert (stats.used_blocks, stats.num_sequences, services.stray_segments()) == (0, 0, [])
