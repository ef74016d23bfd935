"""Leases with real processes: cache, compute and gateways started apart. A gateway killed (SIGKILL)
mid-stream leaves no block used once its session lapses; a new gateway on the same cache and compute serves
the same outputs; a gateway stalled past its TTL recomputes its requests in a new session; two gateways on
one cache serve side by side; a gateway stopped cleanly closes its session at once."""

import glob
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cli.launch import GATEWAY_SERVICE
from protos import cache_pb2
from sdk import Client
from tests.e2e.cache_process import Service
from tests.helpers import free_port, start, stop, wait_healthy

TTL_S, MARGIN_S = 2.0, 3.0
PROMPTS = [
    "The capital of France is",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List the planets of the solar system in order:",
]


class Gateway:
    def __init__(self, tmp, name: str, cache: Service, compute_target: str) -> None:
        self.target = f"127.0.0.1:{free_port()}"
        argv = ["--port", self.target.rsplit(":", 1)[1], "--cache-target", cache.target,
                "--compute-target", compute_target, "--session-ttl", str(TTL_S)]  # fmt: skip
        self.proc = start("gateway", *argv, log_path=tmp / f"{name}.log")
        try:
            wait_healthy(self.target, self.proc, timeout=120, service=GATEWAY_SERVICE)
        except BaseException:
            stop(self.proc)
            raise

    def client(self) -> Client:
        return Client(self.target, timeout=120)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """A cache and a compute service, apart: the gateways come and go."""
    tmp = tmp_path_factory.mktemp("leases")
    cache = Service(tmp, "--kv-blocks", "256")
    compute_target = f"127.0.0.1:{free_port()}"
    compute = start(
        "compute_service", "--port", compute_target.rsplit(":", 1)[1], "--dtype", "float32", "--insecure",
        log_path=tmp / "compute.log",
    )  # fmt: skip
    try:
        wait_healthy(compute_target, compute, timeout=120)
        yield tmp, cache, compute_target
    finally:
        stop(compute)
        cache.stop()
        assert not glob.glob(f"/dev/shm/pagedserve-kv-{cache.proc.pid}-*")  # its segment is removed


def greedy(gateway: Gateway, prompt: str, max_tokens: int = 24) -> list[int]:
    with gateway.client() as client:
        return client.generate(
            prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ).token_ids


def wait_released(cache: Service, sessions: int) -> cache_pb2.CacheStats:
    """Polls until no block is used and `sessions` are open, for at most TTL + margin."""
    deadline = time.monotonic() + TTL_S + MARGIN_S
    while True:
        stats = cache.stats()
        if (stats.used_blocks, stats.num_sequences, stats.num_sessions) == (0, 0, sessions):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def test_a_killed_gateways_blocks_are_freed_within_its_ttl_and_a_new_gateway_serves_alike(services):
    tmp, cache, compute_target = services
    first = Gateway(tmp, "gateway-1", cache, compute_target)
    try:
        reference = greedy(first, PROMPTS[1])
        with first.client() as client:
            stream = client.stream(prompt=PROMPTS[1], max_tokens=400, temperature=0.0, ignore_eos=True)
            for index, _ in enumerate(stream):
                if index == 8:
                    break
            held = cache.stats()
            first.proc.kill()  # SIGKILL: no clean shutdown, no CloseSession
            first.proc.wait(10)
    finally:
        stop(first.proc)
    assert held.used_blocks > 0 and held.num_sessions == 1, held
    released = wait_released(cache, sessions=0)
    assert released.cached_blocks > 0  # the killed stream's written blocks stay in the prefix cache

    second = Gateway(tmp, "gateway-2", cache, compute_target)
    try:
        assert greedy(second, PROMPTS[1]) == reference
        wait_released(cache, sessions=1)
    finally:
        assert stop(second.proc) == 0
    wait_released(cache, sessions=0)  # stopped cleanly: its session closed at once


def test_two_gateways_on_one_cache_serve_side_by_side(services):
    tmp, cache, compute_target = services
    gateways = [Gateway(tmp, f"gateway-side-{index}", cache, compute_target) for index in range(2)]
    try:
        references = [greedy(gateways[0], prompt) for prompt in PROMPTS]
        jobs = [(gateway, prompt) for gateway in gateways for prompt in PROMPTS]
        with ThreadPoolExecutor(len(jobs)) as pool:
            outputs = list(pool.map(lambda job: greedy(*job), jobs))
        assert outputs == references * 2
        assert wait_released(cache, sessions=2).num_sessions == 2
    finally:
        for gateway in gateways:
            stop(gateway.proc)
    wait_released(cache, sessions=0)


def test_a_gateway_stalled_past_its_ttl_recomputes_its_requests_in_a_new_session(services):
    tmp, cache, compute_target = services
    gateway = Gateway(tmp, "gateway-stalled", cache, compute_target)
    try:
        reference = greedy(gateway, PROMPTS[2], max_tokens=48)
        with gateway.client() as client:
            stream = client.stream(prompt=PROMPTS[2], max_tokens=48, temperature=0.0, ignore_eos=True)
            tokens = list(next(stream).token_ids)
            os.kill(gateway.proc.pid, signal.SIGSTOP)
            try:
                wait_released(cache, sessions=0)  # the session lapsed: its blocks are freed
            finally:
                os.kill(gateway.proc.pid, signal.SIGCONT)
            for chunk in stream:
                tokens += chunk.token_ids
        assert tokens == reference
        wait_released(cache, sessions=1)
        assert "session_lost" in gateway.proc.log_path.read_text()
    finally:
        stop(gateway.proc)
    wait_released(cache, sessions=0)
