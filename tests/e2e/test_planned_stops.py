"""Planned and unplanned stops of `pagedserve up` (the tiny random model, which starts fast): SIGTERM writes
the prefix cache's blocks to the KV tier, so a restarted stack serves a 2,500-token prompt from it; when the
launcher dies (kill -9) the gateway drains while compute and cache still serve it, then compute stops, then
the cache, as on SIGTERM."""

import os
import random
import signal
import time

import pytest

from cli.launch import Stack
from common.healthcheck import serving
from tests.e2e.streaming import start_streams
from tests.helpers import ROOT, log_events
from tests.processes import gone, left_by, services_of, stopped
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e
BLOCK_SIZE = 16
PROMPT = [random.Random(35).randrange(3, 256) for _ in range(2500)]
# Every full block but the one holding the last token (whose logits are needed).
REUSABLE = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
STREAMS, NEW_TOKENS = 4, 200


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    path = save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", max_position_embeddings=4096)
    tokenizer.save_pretrained(path)
    return path


def start(model, logs, *flags: str) -> Stack:
    return Stack.start("--model", str(model), "--dtype", "float32", "--kv-blocks", "512", "--log-format",
                       "json", *flags, log_dir=logs, cwd=ROOT, timeout=300)  # fmt: skip


def events(stack: Stack, name: str) -> list[dict]:
    return [event for event in log_events(stack.proc.log_path) if event["event"] == name]


def test_sigterm_writes_the_cached_blocks_and_the_restarted_stack_serves_them(model, logs, tmp_path):
    """As the issue's scenario: one prompt, SIGTERM, the same storage, the same prompt. Its blocks were used
    once, never hot (--kv-tier-hot 0.8): only the stop's flush writes them."""
    tier = ("--kv-tier", "rocksdb", "--kv-tier-path", str(tmp_path / "tier"))
    greedy = dict(token_ids=PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    first = start(model, logs, *tier)
    try:
        with first.client() as client:
            cold = client.generate(**greedy)
    finally:
        assert first.stop() == 0
    assert cold.usage.cached_tokens == 0
    (flushed,) = events(first, "kv_tier_flushed")
    assert flushed["blocks"] >= REUSABLE // BLOCK_SIZE and flushed["stopped_by"] == "done", flushed
    second = start(model, logs, *tier)
    try:
        with second.client() as client:
            warm = client.generate(**greedy)
    finally:
        assert second.stop() == 0
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


def test_a_killed_launcher_drains_the_gateway_while_compute_and_cache_serve_it(model, logs):
    """Compute is stopped (SIGSTOP) from before the kill until the gateway drains, so the streams are still
    running when the services learn that the launcher is gone."""
    stack = start(model, logs, "--drain-timeout", "120", "--step-timeout", "120")
    pids = services_of(stack.proc.pid)
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
    finally:
        for thread in threads:
            thread.join(10)
        for pid in pids.values():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        stack.stop()
    assert wait_until(lambda: not left_by([pids["cache"]]), 5), "the cache unlinked its segment and fence"
    assert len(events(stack, "lifeline_ended")) == 3, "each service stopped on its lifeline"


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
