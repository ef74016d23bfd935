"""Leases with real processes: cache, compute and gateways started apart. A gateway killed (SIGKILL)
mid-stream leaves no block used once its session lapses; a new gateway on the same cache and compute serves
the same outputs; a gateway stalled past its TTL recomputes its requests in a new session; two gateways on
one cache serve side by side; a gateway stopped cleanly closes its session at once; the late Forward of a
gateway stalled past its TTL is refused by compute (the session fence) and writes nothing."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.server import channel
from protos import cache_pb2, compute_pb2, compute_pb2_grpc
from tests.e2e.cache_process import Service
from tests.e2e.gateway_process import Gateway
from tests.helpers import free_port, start, stop, wait_healthy
from tests.processes import left_by
from tests.processes import stopped as process_stopped

TTL_S, MARGIN_S = 2.0, 3.0
TTL = ("--session-ttl", str(TTL_S))
PROMPTS = [
    "The capital of France is",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List the planets of the solar system in order:",
]


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """A cache and a compute service, apart: the gateways come and go."""
    tmp = tmp_path_factory.mktemp("leases")
    # --debug-read-kv: the fencing test compares the pool's bytes before and after a refused Forward.
    cache = Service(tmp, "--kv-blocks", "256", "--debug-read-kv")
    compute_target = f"127.0.0.1:{free_port()}"
    compute = start(
        "compute_service", "--port", compute_target.rsplit(":", 1)[1], "--dtype", "float32", "--insecure",
        log_path=tmp / "compute.log",
    )  # fmt: skip
    try:
        wait_healthy(compute_target, compute, timeout=120)
        yield tmp, cache, compute_target, compute
    finally:
        stop(compute)
        cache.stop()
        assert not left_by([cache.proc.pid]), "its segment and fence are removed"


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
    tmp, cache, compute_target, _ = services
    first = Gateway(tmp, "gateway-1", cache, compute_target, *TTL)
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

    second = Gateway(tmp, "gateway-2", cache, compute_target, *TTL)
    try:
        assert greedy(second, PROMPTS[1]) == reference
        wait_released(cache, sessions=1)
    finally:
        assert stop(second.proc) == 0
    wait_released(cache, sessions=0)  # stopped cleanly: its session closed at once


def test_two_gateways_on_one_cache_serve_side_by_side(services):
    tmp, cache, compute_target, _ = services
    gateways = [Gateway(tmp, f"gateway-side-{index}", cache, compute_target, *TTL) for index in range(2)]
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
    tmp, cache, compute_target, _ = services
    gateway = Gateway(tmp, "gateway-stalled", cache, compute_target, *TTL)
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


def pool_bytes(cache: Service, layers: tuple[int, ...]) -> list[bytes]:
    """The K/V of every block in these layers, as the cache reads them."""
    blocks = cache.stats().total_blocks
    read = cache.stub.ReadBlock
    return [read(cache_pb2.ReadBlockRequest(block_id=block, layer=layer, include_data=True)).data
            for layer in layers for block in range(blocks)]  # fmt: skip


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_stalled_gateways_late_forward_is_refused_and_writes_nothing(services):
    """Compute is stopped while idle; the stalled gateway reserves and sends its prefill's Forward, which
    waits in compute's socket, and is stopped past its TTL: the cache frees its blocks, and once compute
    goes on it refuses that Forward (the fence), so no byte of the pool changes. The other gateway's cached
    prompts serve it as before, and the stalled one, continued, recomputes its request in a new session."""
    tmp, cache, compute_target, compute = services
    late, late_tokens, gateways = PROMPTS[1] + " It was signed", [], []
    logged = len(compute.log_path.read_text())

    def compute_log() -> str:
        """Compute's log from this test on (the stalled gateway's test above has a refusal too)."""
        return compute.log_path.read_text()[logged:]

    try:
        gateways.append(
            stalled := Gateway(tmp, "gateway-late", cache, compute_target, *TTL, "--step-timeout", "300")
        )
        gateways.append(other := Gateway(tmp, "gateway-other", cache, compute_target, *TTL))
        references = [greedy(other, prompt) for prompt in (PROMPTS[0], PROMPTS[2])]
        layers = (0, compute_info(compute_target).num_layers - 1)
        with stalled.client() as client, ThreadPoolExecutor(1) as pool:
            os.kill(compute.pid, signal.SIGSTOP)
            try:
                stream = pool.submit(lambda: [t for c in client.stream(prompt=late, max_tokens=24,
                                     temperature=0.0, ignore_eos=True) for t in c.token_ids])  # fmt: skip
                wait_for(lambda: cache.stats().num_sequences == 1, 30, "the stalled gateway reserved")
                time.sleep(1.0)  # its Forward is sent: it waits for compute
                with process_stopped(stalled.proc.pid):
                    wait_released(cache, sessions=1)  # its session lapsed: the cache freed its blocks
                    before = pool_bytes(cache, layers)
                    os.kill(compute.pid, signal.SIGCONT)
                    refusal = "is not open at the cache service"
                    wait_for(lambda: refusal in compute_log(), 60, "compute refused it")
                    assert pool_bytes(cache, layers) == before, "the late Forward wrote nothing"
                    assert [greedy(other, p) for p in (PROMPTS[0], PROMPTS[2])] == references
                    expected = greedy(other, late)
            finally:
                os.kill(compute.pid, signal.SIGCONT)
            late_tokens = stream.result(timeout=120)
        (line,) = [ln for ln in compute_log().splitlines() if refusal in ln]
        assert "rpc_refused" in line and "Forward" in line and "FAILED_PRECONDITION" in line, line
        assert late_tokens == expected, "recomputed in a new session, the same greedy output"
        wait_released(cache, sessions=2)
    finally:
        for gateway in gateways:
            stop(gateway.proc)
    wait_released(cache, sessions=0)


def compute_info(target: str):
    with channel(target) as ch:
        return compute_pb2_grpc.ComputeStub(ch).GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=30)
