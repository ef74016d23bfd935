"""Metrics, request ids in the logs, `pagedserve monitor`/`stats`, on the shared float32 stack."""

import json
import shutil
import subprocess
import threading
import urllib.request
import uuid

import pytest

from cli.scrape import scrape
from tests.helpers import PAGEDSERVE, log_events, promtool_problems

pytestmark = pytest.mark.e2e
PROMPT = "The capital of France is"
LONG = 150  # tokens of the request that runs while metrics and the monitor are read


def _value(samples: dict, name: str, **labels) -> float:
    return samples[name, tuple(sorted(labels.items()))]


def _scrape_all(stack) -> dict[str, dict]:
    return {service: scrape(stack.metrics_url(service)) for service in ("gateway", "cache", "compute")}


def _pagedserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PAGEDSERVE, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def during_and_after(stack_fp32):
    """Metrics and `monitor --once` while a long request runs, then metrics after it and a short one ended."""
    before = _scrape_all(stack_fp32)
    started, done = threading.Event(), threading.Event()

    def long_request():
        with stack_fp32.client() as client:
            # Long enough to outlast starting the monitor process, even on a loaded machine.
            for _ in client.stream(prompt=PROMPT, max_tokens=LONG, temperature=0, ignore_eos=True):
                started.set()
        done.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    assert started.wait(120)
    during = _scrape_all(stack_fp32)
    monitor = _pagedserve(
        "monitor", "--metric", "cache_usage", "--once", "--metrics-port", str(stack_fp32.metrics_base)
    )
    worker.join(300)
    assert done.is_set()
    with stack_fp32.client() as client:
        client.generate(prompt=PROMPT, max_tokens=4, temperature=0)
    return before, during, _scrape_all(stack_fp32), monitor


def test_metrics_move_during_and_after_generation(during_and_after):
    before, during, after, _ = during_and_after
    assert _value(during["cache"], "pagedserve_kv_cache_usage_ratio") > 0
    assert _value(during["cache"], "pagedserve_kv_blocks", state="used") > 0
    assert _value(during["gateway"], "pagedserve_requests_running") >= 1
    assert _value(after["cache"], "pagedserve_kv_blocks", state="used") == 0
    for name in ("pagedserve_prefix_cache_queries_total", "pagedserve_kv_evictions_total"):
        assert name in {key[0] for key in after["cache"]}
    grew = [
        ("gateway", "pagedserve_time_to_first_token_seconds_count", 2),
        ("gateway", "pagedserve_request_queue_time_seconds_count", 2),
        ("gateway", "pagedserve_inter_token_latency_seconds_count", LONG - 1 + 3),
        ("gateway", "pagedserve_e2e_request_latency_seconds_count", 2),
        ("gateway", "pagedserve_generation_tokens_total", LONG + 4),
        ("compute", "pagedserve_forward_step_duration_seconds_count", LONG + 1),
        # Each prompt computes at least its last token (the rest may come from the prefix cache).
        ("compute", "pagedserve_forward_step_tokens_sum", 2 * 1 + LONG - 1 + 3),
    ]
    for service, name, at_least in grew:
        assert _value(after[service], name) - _value(before[service], name) >= at_least, name
    assert _value(after["gateway"], "pagedserve_requests_finished_total", finish_reason="length") >= 2


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: run `make setup`")
@pytest.mark.parametrize("service", ["gateway", "cache", "compute"])
def test_promtool_accepts_the_exposition(stack_fp32, during_and_after, service):
    text = urllib.request.urlopen(stack_fp32.metrics_url(service), timeout=5).read()
    assert promtool_problems(text) == []


def test_monitor_once_shows_usage_while_requests_run(during_and_after):
    monitor = during_and_after[3]
    assert monitor.returncode == 0, monitor.stderr
    figures = dict(line.split() for line in monitor.stdout.splitlines())
    assert float(figures["cache_usage"].rstrip("%")) > 0
    assert float(figures["running"]) >= 1


def test_stats_prints_a_table_and_json(stack_fp32):
    table = _pagedserve("stats", "--cache-target", stack_fp32.cache_target)
    assert table.returncode == 0, table.stderr
    assert "total_blocks" in table.stdout and "512" in table.stdout
    as_json = _pagedserve("stats", "--json", "--cache-target", stack_fp32.cache_target)
    stats = json.loads(as_json.stdout)
    assert stats["total_blocks"] == 512 and stats["allocator"] == "freelist"
    assert isinstance(stats["allocator_stats"], dict)


def test_one_request_id_is_followed_through_the_three_logs(stack_fp32):
    request_id = f"trace-{uuid.uuid4().hex[:8]}"
    with stack_fp32.client() as client:
        result = client.generate(prompt=PROMPT, max_tokens=3, temperature=0, request_id=request_id)
    assert result.request_id == request_id
    seen: dict[str, set[str]] = {}
    for event in log_events(stack_fp32.proc.log_path):
        if request_id in event.get("request_id", "").split(","):
            seen.setdefault(event["service"], set()).add(event["event"])
    assert set(seen) == {"gateway", "cache", "compute"}, seen
    assert {"request", "finished"} <= seen["gateway"]
    assert "rpc" in seen["cache"] and "rpc" in seen["compute"]
