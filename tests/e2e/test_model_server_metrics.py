"""The gateway's vLLM-named metrics (the Gateway API Inference Extension's model-server protocol) on a real
stack: names, types and labels as vLLM's, served on --metrics-port and on the HTTP API port (--http-metrics),
and values that agree with what the requests reported, pagedserve's own series and the cache's GetStats,
after a run with prefix hits and while a request runs."""

import json
import shutil
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.scrape import parse
from tests.e2e.prompts import long_text
from tests.e2e.stack import start_stack
from tests.helpers import promtool_problems

pytestmark = pytest.mark.e2e
NUM_BLOCKS = 64
SHARED = long_text(12)  # a prefix of several blocks the second request finds cached
TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_success": "counter",
    "vllm:cache_config_info": "gauge",
}
# vLLM's series and the pagedserve series that observe the same values.
SAME_AS = {
    "vllm:time_to_first_token_seconds": "pagedserve_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "pagedserve_inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds": "pagedserve_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "pagedserve_request_queue_time_seconds",
}


@pytest.fixture(scope="module")
def stack(logs):
    stack = start_stack(logs, "--dtype", "float32", "--kv-blocks", str(NUM_BLOCKS), "--http-metrics", "on")
    yield stack
    assert stack.stop() == 0


def read(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def http_metrics(stack) -> str:
    return read(stack.http_url.removesuffix("/v1") + "/metrics")


def value(samples: dict, name: str, **labels) -> float:
    return samples[name, tuple(sorted(labels.items()))]


@pytest.fixture(scope="module")
def run(stack):
    """Scrapes before and after two requests on one long prefix (the second finds it cached), and while a
    third one runs."""
    model = served_model(stack)
    before = parse(read(stack.metrics_url()))
    cache_before = stack.stats()
    with stack.client() as client:
        results = [
            client.generate(prompt=f"{SHARED} Question {i}: what comes next?", max_tokens=6, temperature=0,
                            ignore_eos=True)
            for i in range(2)
        ]  # fmt: skip
    after = parse(read(stack.metrics_url()))
    cache_after = stack.stats()
    during = running_samples(stack)
    return model, before, after, results, cache_before, cache_after, during


def served_model(stack) -> str:
    return json.loads(read(stack.http_url + "/models"))["data"][0]["id"]


def running_samples(stack) -> dict:
    """The gateway's samples while a long request runs."""
    started = threading.Event()

    def long_request():
        with stack.client() as client:
            request = {"max_tokens": 80, "temperature": 0, "ignore_eos": True}
            for _ in client.stream(prompt="Count to one hundred:", **request):
                started.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    assert started.wait(120)
    samples = parse(read(stack.metrics_url()))
    worker.join(300)
    return samples


def test_names_types_and_labels_are_vllms(stack, run):
    model = run[0]
    families = {f.name: f for f in text_string_to_metric_families(read(stack.metrics_url()))}
    assert {name: families[name].type for name in TYPES} == TYPES
    for name in TYPES:
        for sample in families[name].samples:
            if name == "vllm:cache_config_info":
                assert sample.labels == {"block_size": "16", "num_gpu_blocks": str(NUM_BLOCKS), "engine": "0"}
                assert sample.value == 1
            else:
                assert (sample.labels["model_name"], sample.labels["engine"]) == (model, "0"), name


def test_the_http_api_port_serves_the_same_registry(stack, run):
    on_http = {f.name for f in text_string_to_metric_families(http_metrics(stack))}
    assert set(TYPES) <= on_http
    assert "pagedserve_requests_running" in on_http


def test_prefix_counters_match_the_requests_and_the_cache(run):
    model, before, after, results, cache_before, cache_after, _ = run
    labels = {"model_name": model, "engine": "0"}
    queries = value(after, "vllm:prefix_cache_queries_total", **labels) - value(
        before, "vllm:prefix_cache_queries_total", **labels
    )
    hits = value(after, "vllm:prefix_cache_hits_total", **labels) - value(
        before, "vllm:prefix_cache_hits_total", **labels
    )
    assert queries == sum(r.usage.prompt_tokens for r in results)
    assert hits == sum(r.usage.cached_tokens for r in results) and results[1].usage.cached_tokens >= 16 * 4
    assert queries == cache_after.prefix_query_tokens - cache_before.prefix_query_tokens
    assert hits == cache_after.prefix_hit_tokens - cache_before.prefix_hit_tokens


def test_latencies_are_the_same_observations_as_pagedserves(run):
    model, before, after, results = run[:4]
    labels = (("engine", "0"), ("model_name", model))

    def grew(name: str, labels=labels) -> float:
        return after[name, labels] - before.get((name, labels), 0.0)

    for ours, theirs in SAME_AS.items():
        for part in ("_count", "_sum"):
            assert grew(ours + part) == pytest.approx(grew(theirs + part, ())), ours + part
    assert grew("vllm:time_to_first_token_seconds_count") == len(results)
    tokens = sum(r.usage.completion_tokens - 1 for r in results)
    assert grew("vllm:inter_token_latency_seconds_count") == tokens
    length = tuple(sorted((*labels, ("finished_reason", "length"))))
    assert grew("vllm:request_success_total", length) == len(results)


def test_usage_counts_held_blocks_and_cached_blocks_as_free(stack, run):
    model, after, cache_after, during = run[0], run[2], run[5], run[6]
    labels = {"model_name": model, "engine": "0"}
    assert value(after, "vllm:kv_cache_usage_perc", **labels) == 0.0
    assert cache_after.used_blocks == 0 and cache_after.cached_blocks >= 4, "the prefix stays cached"
    assert value(during, "vllm:kv_cache_usage_perc", **labels) > 0
    assert value(during, "vllm:num_requests_running", **labels) == 1
    assert value(during, "vllm:num_requests_waiting", **labels) == 0
    preemptions = value(after, "vllm:num_preemptions_total", **labels)
    assert preemptions == value(after, "pagedserve_preemptions_total")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: run `make setup`")
def test_promtool_accepts_both_expositions(stack, run):
    for text in (read(stack.metrics_url()), http_metrics(stack)):
        assert promtool_problems(text.encode()) == []
