"""The gateway when its peers die (real processes, a tiny random-weight model): a compute killed (kill -9)
and restarted under four streams (they go on from the K/V already written: no prefill after the restart,
the tokens of a fault-free run), a cache killed and restarted or a compute hung (SIGSTOP) mid-stream (the
request ends with the tokens of a fault-free run), a compute gone past the grace (UNAVAILABLE naming it), one
step's fault beside four streams (only its request fails, the streams keep their tokens), health under 200
streams."""

import json
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.healthcheck import status
from common.server import channel
from protos import cache_pb2, cache_pb2_grpc
from sdk.client import Client, GenerationError
from tests.helpers import free_port, log_events, start, stop, wait_healthy
from tests.processes import segments_of

pytestmark = pytest.mark.e2e
GATEWAY_SERVICE = "pagedserve.v1.Generation"
FAULTY_REQUEST = "inject-a-step-fault"
# The request that fails in each stage of its steps (tests/step_hooks.py: FailStep, loaded by --step-hook).
FAULTY = {
    "run": FAULTY_REQUEST,
    **{stage: f"{FAULTY_REQUEST}-{stage}" for stage in ("schedule", "reserve", "update")},
}
FAULTS = ",".join(f"{stage}:{request_id}" for stage, request_id in FAULTY.items())
PROMPT = [5, 17, 99, 42, 7, 200, 31, 64, 3, 150]
GREEDY = dict(token_ids=PROMPT, max_tokens=300, temperature=0.0, ignore_eos=True)
# Four streams at once: their blocks (with a multi-step's lookahead) fit the cache's 64, so none is preempted.
FOUR = [PROMPT, [8, 8, 8, 2, 9], [200, 31, 64, 3, 150, 9, 11], [77, 1, 250, 19]]
STREAMS = dict(max_tokens=150, temperature=0.0, ignore_eos=True)
FAULT_AFTER = 10  # tokens every stream has when the fault comes


class Services:
    """Cache, compute and gateway processes on free ports; each can be killed and started again."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.model, self.logs = model, logs
        self.ports = {name: free_port() for name in ("cache", "compute")}
        self.targets = {name: f"127.0.0.1:{port}" for name, port in self.ports.items()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.all_procs: list[tuple[str, subprocess.Popen]] = []
        self.starts = 0

    def start(self, name: str, *args: str, port: int | None = None) -> str:
        """Starts the service (on its own port unless given) and waits until it serves; returns its target."""
        self.starts += 1
        port = port or self.ports[name]
        argv = {
            "cache": ["--kv-blocks", "64", "--insecure"],
            "compute": ["--model", str(self.model), "--dtype", "float32", "--threads", "1", "--insecure"],
            "gateway": ["--model", str(self.model), "--block-size", "16", "--log-format", "json",
                        "--cache-target", self.targets["cache"], "--compute-target", self.targets["compute"]],
        }[name]  # fmt: skip
        module = {"cache": "cache_service", "compute": "compute_service", "gateway": "gateway"}[name]
        log_path = self.logs / f"{name}-{self.starts}.log"
        proc = start(module, *argv, "--port", str(port), *args, log_path=log_path)
        self.procs[f"{name}:{port}"] = proc
        self.all_procs.append((name, proc))
        target = f"127.0.0.1:{port}"
        wait_healthy(target, proc, 120, GATEWAY_SERVICE if name == "gateway" else "")
        return target

    def kill(self, name: str) -> None:
        proc = self.procs.pop(f"{name}:{self.ports[name]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop_all(self) -> dict[str, int]:
        """SIGTERM to each (SIGKILL after 20 s); their exit codes."""
        return {name: stop(proc) for name, proc in reversed(self.procs.items())}


@pytest.fixture(scope="module")
def services(tmp_path_factory, tiny_model):
    svc = Services(tiny_model, tmp_path_factory.mktemp("logs"))
    try:
        svc.start("cache")
        svc.start("compute")
        # NOTE: a grace that outlasts a compute's start on a loaded machine (the default, 30 s, may not).
        svc.gateway = svc.start(
            "gateway", "--peer-restart-grace", "120", "--step-hook", f"tests.step_hooks:FailStep={FAULTS}",
            port=free_port(),
        )  # fmt: skip
        yield svc
    finally:
        codes = svc.stop_all()
    assert set(codes.values()) == {0}, f"not every service stopped on SIGTERM: {codes}"
    caches = [proc.pid for name, proc in svc.all_procs if name == "cache"]
    assert len(caches) == 2 and not any(map(segments_of, caches)), "a segment was left in /dev/shm"


@pytest.fixture(scope="module")
def reference(services):
    with Client(services.gateway, timeout=60) as client:
        return greedy(client).token_ids


def greedy(client: Client, **kwargs):
    return client.generate(**GREEDY, **kwargs)


@pytest.fixture(scope="module")
def four_reference(services):
    return four_streams(services, lambda: None)[0]


def gateway_events(services: Services, event: str) -> list[dict]:
    """The first gateway's log events of that name, in order."""
    path = Path(services.procs[f"gateway:{services.gateway.rsplit(':', 1)[1]}"].log_path)
    return [line for line in log_events(path) if line["event"] == event]


def recoveries(services: Services) -> list[str]:
    """The peers the first gateway attached again after, in order (from its log)."""
    log = Path(services.procs[f"gateway:{services.gateway.rsplit(':', 1)[1]}"].log_path).read_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [line["peer"] for line in lines if line["event"] == "peer_recovered"]


def lost(services: Services) -> list[str]:
    """The gateway's peer_lost events, each as `peer: why`."""
    return [f"{line['peer']}: {line['error']}" for line in gateway_events(services, "peer_lost")]


def four_streams(services: Services, fault) -> tuple[list[list[int]], list[list[tuple[float, int]]], object]:
    """The FOUR prompts streamed at once; once each has FAULT_AFTER tokens, `fault()` runs; then each is read
    to its end. Returns each stream's tokens, its chunks' (arrival, tokens so far), and what fault gave."""
    started = [threading.Event() for _ in FOUR]
    arrivals: list[list[tuple[float, int]]] = [[] for _ in FOUR]

    def consume(i: int) -> list[int]:
        tokens = []
        with Client(services.gateway, timeout=120) as client:
            for chunk in client.stream(token_ids=FOUR[i], **STREAMS):
                tokens.extend(chunk.token_ids)
                arrivals[i].append((time.monotonic(), len(tokens)))
                if len(tokens) >= FAULT_AFTER:
                    started[i].set()
        return tokens

    with ThreadPoolExecutor(len(FOUR)) as pool:
        streams = [pool.submit(consume, i) for i in range(len(FOUR))]
        assert all(event.wait(60) for event in started)
        result = fault()
        running = sum(not stream.done() for stream in streams)
        outputs = [stream.result(timeout=120) for stream in streams]
    assert running == len(FOUR), "every stream ran while the fault came"
    return outputs, arrivals, result


def step_tokens(metrics_port: int) -> dict[str, float]:
    """Compute's pagedserve_forward_step_tokens histogram: its count, sum and the count of steps of <= 4
    tokens."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "pagedserve_forward_step_tokens"
    ]
    values = {
        s.name.rsplit("_", 1)[1]: s.value for s in family.samples if s.labels.get("le") in (None, "4.0")
    }
    return {"count": values["count"], "sum": values["sum"], "at_most_4": values["bucket"]}


def stream_through(services: Services, fault) -> list[int]:
    """Streams the greedy request; after its first token, `fault()` runs; returns the tokens streamed."""
    tokens, started = [], threading.Event()

    def consume():
        with Client(services.gateway, timeout=120) as client:
            for chunk in client.stream(**GREEDY):
                tokens.extend(chunk.token_ids)
                started.set()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(consume)
        assert started.wait(60)
        fault()
        done.result(timeout=120)
    return tokens


def test_a_compute_killed_mid_decode_goes_on_from_the_kv_already_written(services, four_reference):
    metrics_port = free_port()

    def kill_and_restart():
        before = admissions(services)
        services.kill("compute")
        killed_at = time.monotonic()
        services.start("compute", "--metrics-port", str(metrics_port))
        return killed_at, before

    outputs, arrivals, (killed_at, before) = four_streams(services, kill_and_restart)
    assert outputs == four_reference
    assert recoveries(services) == ["compute"], (
        f"the streams were running when compute died: {lost(services)}"
    )
    assert gateway_events(services, "attached")[-1]["kept_running"] == len(FOUR), "the tables were kept"
    # The streams went on in the blocks they held: none was freed and admitted again (its prefix looked up,
    # its last block copied), as a recompute does.
    assert admissions(services) == before
    # Every step the new compute ran was a decode step of the four streams, and it computed no more tokens
    # than the streams had still to receive at the kill.
    had = [max((n for at, n in chunks if at <= killed_at), default=0) for chunks in arrivals]
    steps = step_tokens(metrics_port)
    assert steps["count"] > 0 and steps["at_most_4"] == steps["count"], steps
    assert steps["sum"] <= sum(STREAMS["max_tokens"] - n for n in had), (steps, had)


def admissions(services: Services) -> tuple[int, int, int]:
    """The cache's counters of sequences admitted: prompt tokens looked up, found cached, blocks copied."""
    stub = cache_pb2_grpc.CacheStub(channel(services.targets["cache"]))
    stats = stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    return stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.copy_on_writes


def test_a_cache_killed_and_restarted_mid_stream_changes_no_token(services, reference):
    def restart_cache():
        services.kill("cache")
        services.start("cache")

    tokens = stream_through(services, restart_cache)
    assert tokens == reference
    assert recoveries(services) == ["compute", "cache"], (
        f"the stream was still running when the cache died: {lost(services)}"
    )
    deadline = time.monotonic() + 10
    while status(services.gateway, GATEWAY_SERVICE) != "SERVING" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status(services.gateway, GATEWAY_SERVICE) == "SERVING", "the new pool is attached"


def test_a_hung_compute_is_lost_at_the_step_deadline_and_attached_again_once_it_answers(services, reference):
    compute = services.procs[f"compute:{services.ports['compute']}"]

    def hang_compute():
        compute.send_signal(signal.SIGSTOP)
        try:
            time.sleep(7)  # past the derived step deadline's 5 s floor
        finally:
            compute.send_signal(signal.SIGCONT)

    started = time.monotonic()
    tokens = stream_through(services, hang_compute)
    assert tokens == reference
    assert recoveries(services) == ["compute", "cache", "compute"], (
        f"the step deadline passed: {lost(services)}"
    )
    assert time.monotonic() - started < 60, "not the 120 s RPC timeout"


@pytest.mark.parametrize("stage", FAULTY)
def test_a_fault_in_one_step_fails_only_its_request(services, four_reference, stage):
    def faulty_request():
        with Client(services.gateway, timeout=60) as client, pytest.raises(GenerationError) as info:
            greedy(client, request_id=FAULTY[stage])
        return info.value

    bisected = len(gateway_events(services, "step_fault_isolated"))
    outputs, _, error = four_streams(services, faulty_request)
    assert error.code == grpc.StatusCode.INTERNAL
    assert f"injected {stage} fault" in error.details and f"request {FAULTY[stage]}" in error.details
    assert outputs == four_reference, "the co-running streams kept their tokens"
    if stage in ("run", "reserve"):  # a failed Forward or Reserve names no row: bisected
        (isolated,) = gateway_events(services, "step_fault_isolated")[bisected:]
        assert len(isolated["seq_ids"]) > 1 and len(isolated["failed"]) == 1, (
            "it shared a step; only it failed"
        )
    else:  # the row's own code raised: it alone was set aside
        faults = [e for e in gateway_events(services, "row_fault") if e["request_id"] == FAULTY[stage]]
        assert len(faults) == 1, faults


def test_health_is_answered_within_a_second_under_200_streams(services):
    with Client(services.gateway, timeout=120) as client, ThreadPoolExecutor(200) as pool:
        requests = [pool.submit(client.generate, token_ids=[3 + i % 200, 9], max_tokens=64, temperature=0.0,
                                ignore_eos=True) for i in range(200)]  # fmt: skip
        time.sleep(0.5)
        checks = []
        for _ in range(3):
            start_at = time.monotonic()
            checks.append(
                (status(services.gateway, GATEWAY_SERVICE, timeout=1.0), time.monotonic() - start_at)
            )
            time.sleep(0.2)
        busy = sum(not r.done() for r in requests)
        results = [r.result() for r in requests]
    assert all(answer == "SERVING" and took < 1.0 for answer, took in checks), checks
    assert busy > 0, "the checks ran while streams were open"
    assert all(len(r.token_ids) == 64 for r in results)


def test_a_compute_gone_past_the_grace_fails_requests_naming_it(services, reference):
    gateway = services.start("gateway", "--peer-restart-grace", "3", port=free_port())
    services.kill("compute")
    # NOTE: resume_timeout 0: the gateway's own answer, which the SDK would otherwise retry.
    with Client(gateway, timeout=60, resume_timeout=0) as client:
        started = time.monotonic()
        with pytest.raises(GenerationError) as info:
            greedy(client)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert f"compute service at {services.targets['compute']} unreachable" in info.value.details
        assert time.monotonic() - started < 30
        with pytest.raises(GenerationError) as again:
            greedy(client)
        assert again.value.code == grpc.StatusCode.UNAVAILABLE and "compute service" in again.value.details
        services.start("compute")
        deadline = time.monotonic() + 20
        while status(gateway, GATEWAY_SERVICE) != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert greedy(client).token_ids == reference
