"""`pagedserve up` as an operator meets it: a killed service comes back (a killed gateway's streams resume on
the new one through the SDK), a killed launcher takes its services along (the gateway drains first while
compute and cache still serve it, as on SIGTERM), SIGTERM drains the gateway and writes the prefix cache to
the KV tier, so a restarted stack serves a 2,500-token prompt from it; no segment is left in /dev/shm. The
tiny model starts fast."""

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cli.launch import Stack
from cli.processes import gone, services_of, standby_of
from common.healthcheck import serving
from sdk.client import Client, GenerationError
from tests.e2e.streaming import start_streams
from tests.helpers import ROOT, log_events
from tests.processes import left_by, segments_of, stopped
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e
STREAMS, NEW_TOKENS = 8, 500
BLOCK_SIZE = 16
PROMPT = [random.Random(35).randrange(3, 256) for _ in range(2500)]
# Every full block but the one holding the last token (whose logits are needed).
REUSABLE = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer):
    model = save_tiny_llama(
        tmp_path_factory.mktemp("models") / "tiny-llama", initializer_range=0.3, max_position_embeddings=4096
    )
    tokenizer.save_pretrained(model)
    return model


def start(tiny_model, logs, *flags: str) -> Stack:
    return Stack.start("--model", str(tiny_model), "--dtype", "float32", "--kv-blocks", "1024", *flags,
                       log_dir=logs, cwd=ROOT, timeout=300)  # fmt: skip


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def test_a_killed_cache_is_restarted_and_its_segment_removed(tiny_model, logs):
    stack = start(tiny_model, logs)
    pids, caches = {}, set()
    try:
        pids = services_of(stack.proc.pid)
        assert set(pids) == {"cache", "compute", "gateway"}
        caches.add(pids["cache"])
        (old,) = segments_of(pids["cache"])
        os.kill(pids["cache"], signal.SIGKILL)
        restarted = lambda: services_of(stack.proc.pid).get("cache", pids["cache"]) != pids["cache"]  # noqa: E731
        assert wait_until(restarted, 10)
        assert wait_until(lambda: serving(stack.cache_target), 60), "the new cache serves"
        assert not old.exists(), "the supervisor removed the dead cache's segment"
        maps = Path(f"/proc/{pids['compute']}/maps")
        assert wait_until(lambda: str(old) not in maps.read_text(), 5), "compute unmapped it"
        assert stack.proc.poll() is None, "up keeps running"
        log = stack.proc.log_path.read_text()
        assert "cache exited (signal SIGKILL); restart 1 in 0.5s" in log
        assert f"removed {old}" in log
        pids = services_of(stack.proc.pid)
        assert pids.keys() == {"cache", "compute", "gateway"}
        caches.add(pids["cache"])
        stack.proc.kill()
        stack.proc.wait()
        assert wait_until(lambda: all(map(gone, pids.values())), 15), "the services died with up"
    finally:
        stack.stop()
        for pid in pids.values():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not left_by(caches), 5), "no segment or fence is left"


def test_sigterm_drains_the_running_requests_and_refuses_new_ones(tiny_model, logs):
    """Compute is stopped (SIGSTOP) while the gateway drains, so no stream can end before the probe is
    answered: a race the streams used to win on a fast step, when the drained gateway had exited and the
    OS refused the probe. The step timeout keeps the pause from counting as a lost compute."""
    stack = start(tiny_model, logs, "--drain-timeout", "120", "--step-timeout", "120")
    results, threads = [], []
    compute, cache = (services_of(stack.proc.pid)[name] for name in ("compute", "cache"))
    try:
        threads = start_streams(stack, STREAMS, NEW_TOKENS, results)
        with stopped(compute):
            stack.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: not serving(stack.target, timeout=1), 10), "NOT_SERVING at once"
            # NOTE: resume_timeout 0: the gateway's own answer, which the SDK would otherwise retry.
            with (
                Client(stack.target, timeout=30, resume_timeout=0) as client,
                pytest.raises(GenerationError) as refused,
            ):
                client.generate(token_ids=[5, 6, 7], max_tokens=4)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert refused.value.details.startswith("draining: the gateway is shutting down")
            assert results == [], "no stream can end while compute is stopped"
        for thread in threads:
            thread.join(60)
        assert results == [("length", NEW_TOKENS)] * STREAMS
        assert stack.proc.wait(60) == 0
    finally:
        stack.stop()
        for thread in threads:
            thread.join(10)
    assert wait_until(lambda: not left_by([cache]), 5), "no segment or fence is left"


def gateway_exits(stack: Stack) -> list[str]:
    """up's lines on the gateway's exits, oldest first."""
    return [line for line in stack.proc.log_path.read_text().splitlines() if "gateway exited" in line]


def test_a_gateway_signalled_at_its_first_serving_drains_and_exits_cleanly(tiny_model, logs):
    """A restarted gateway signalled the moment it first serves drains and exits 0: it reports SERVING only
    once SIGTERM drains it. It used to serve while it still started its HTTP API, and a SIGTERM then killed
    it unannounced (the drain test above lost that race in CI)."""
    stack = start(tiny_model, logs)
    try:
        old = services_of(stack.proc.pid)["gateway"]
        os.kill(old, signal.SIGKILL)
        assert wait_until(lambda: services_of(stack.proc.pid).get("gateway", old) != old, 10)
        new = services_of(stack.proc.pid)["gateway"]
        assert wait_until(lambda: serving(stack.target, timeout=1), 60, interval=0.005)
        os.kill(new, signal.SIGTERM)
        assert wait_until(lambda: len(gateway_exits(stack)) == 2, 30), gateway_exits(stack)
        assert gateway_exits(stack)[1].startswith("pagedserve: gateway exited (exit code 0)")
    finally:
        stack.stop()


def test_a_killed_gateway_is_restarted_and_the_sdk_resumes_its_streams_on_it(tiny_model, logs):
    """kill -9 of the gateway under `up` (compute stopped meanwhile, so that no stream ends first): up starts
    a new one on the same port and every stream, greedy or seeded, resumes there once and ends as the
    fault-free run does."""
    stack = start(tiny_model, logs)
    kinds = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 77}]
    requests = [dict(token_ids=[3 + i, 40, 50, 60], max_tokens=300, ignore_eos=True, **kinds[i % 2])
                for i in range(4)]  # fmt: skip
    received = [0] * len(requests)

    def run(i: int) -> list:
        with stack.client() as client:
            chunks = []
            for chunk in client.stream(**requests[i]):
                chunks.append(chunk)
                received[i] += len(chunk.token_ids)
            return chunks

    try:
        with stack.client() as client:
            expected = [client.generate(**request) for request in requests]
        services = services_of(stack.proc.pid)
        with ThreadPoolExecutor(len(requests)) as pool:
            running = [pool.submit(run, i) for i in range(len(requests))]
            assert wait_until(lambda: min(received) >= 5, 60), received
            with stopped(services["compute"]):
                os.kill(services["gateway"], signal.SIGKILL)
                assert wait_until(
                    lambda: services_of(stack.proc.pid).get("gateway") not in (None, services["gateway"]), 30
                )
            results = [future.result(120) for future in running]
        for chunks, reference in zip(results, expected, strict=True):
            assert [t for c in chunks for t in c.token_ids] == reference.token_ids
            assert "".join(c.text for c in chunks) == reference.text
            last = chunks[-1]
            assert (last.finish_reason, last.usage.completion_tokens, last.resumes) == (
                reference.finish_reason, reference.usage.completion_tokens, 1
            )  # fmt: skip
        assert "gateway exited (signal SIGKILL); restart 1" in stack.proc.log_path.read_text()
    finally:
        stack.stop()


def events(stack: Stack, name: str) -> list[dict]:
    return [event for event in log_events(stack.proc.log_path) if event["event"] == name]


def test_sigterm_writes_the_cached_blocks_and_the_restarted_stack_serves_them(tiny_model, logs, tmp_path):
    """As the issue's scenario: one prompt, SIGTERM, the same storage, the same prompt. Its blocks were used
    once, never hot (--kv-tier-hot 0.8): only the stop's flush writes them."""
    tier = ("--log-format", "json", "--kv-tier", "rocksdb", "--kv-tier-path", str(tmp_path / "tier"))
    served, flushes, greedy = [], [], dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        stack = start(tiny_model, logs, *tier)
        try:
            with stack.client() as client:
                served.append(client.generate(token_ids=PROMPT, **greedy))
        finally:
            assert stack.stop() == 0
        flushes.append(events(stack, "kv_tier_flushed"))
    cold, warm = served
    assert cold.usage.cached_tokens == 0
    (flushed,) = flushes[0]
    assert flushed["blocks"] >= REUSABLE // BLOCK_SIZE and flushed["stopped_by"] == "done", flushed
    assert warm.usage.cached_tokens >= 2400
    assert warm.usage.cached_tokens == REUSABLE
    assert warm.token_ids == cold.token_ids, "the tier's blocks are the computed ones"
    ttft = cold.timings.time_to_first_token_s, warm.timings.time_to_first_token_s
    print(f"tiny model, {len(PROMPT)}-token prompt: TTFT cold {ttft[0]:.3f} s, restarted {ttft[1]:.3f} s")


def exit_times(pids: dict[str, int], timeout: float) -> dict[str, float]:
    """When each process was first seen gone, polled every 5 ms."""
    seen, deadline = {}, time.monotonic() + timeout
    while len(seen) < len(pids) and time.monotonic() < deadline:
        now = time.monotonic()
        seen.update({name: now for name, pid in pids.items() if name not in seen and gone(pid)})
        time.sleep(0.005)
    return seen


def test_a_killed_launcher_drains_the_gateway_while_compute_and_cache_serve_it(tiny_model, logs):
    """Compute is stopped (SIGSTOP) from before the kill until the gateway drains, so the streams are still
    running when the services learn that the launcher is gone. Compute's standby stops on the same lifeline,
    without taking over."""
    stack = start(tiny_model, logs, "--log-format", "json", "--drain-timeout", "120", "--step-timeout", "120")
    standby = wait_until(lambda: (standby_of(stack.proc.pid) or (0, False))[1], 300)
    assert standby, "the standby loaded"
    pids = {**services_of(stack.proc.pid), "standby": standby_of(stack.proc.pid)[0]}
    results, threads = [], []
    try:
        threads = start_streams(stack, STREAMS, NEW_TOKENS, results)
        with stopped(pids["compute"]):
            stack.proc.kill()
            stack.proc.wait()
            assert wait_until(lambda: not serving(stack.target, timeout=1), 10), "the gateway drains"
            time.sleep(1.0)
            assert not any(gone(pid) for pid in pids.values()), "every service still runs"
            assert serving(stack.cache_target, timeout=5), "the cache still serves"
            assert results == [], "no stream can end while compute is stopped"
        for thread in threads:
            thread.join(60)
        exited = exit_times(pids, 60)
        assert results == [("length", NEW_TOKENS)] * STREAMS
        assert exited.keys() == pids.keys(), exited
        assert exited["gateway"] <= exited["compute"] <= exited["cache"], exited
        assert exited["gateway"] <= exited["standby"] <= exited["cache"], exited
    finally:
        for thread in threads:
            thread.join(10)
        for pid in pids.values():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        stack.stop()
    assert wait_until(lambda: not left_by([pids["cache"]]), 5), "the cache unlinked its segment and fence"
    assert len(events(stack, "lifeline_ended")) == 4, "each service and the standby stopped on its lifeline"
    assert not events(stack, "standby_taking_over")
