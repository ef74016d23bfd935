"""The gateway's metrics under vLLM's names, types, units and labels: the model-server protocol that the
Gateway API Inference Extension's endpoint picker scrapes (queue, running requests, KV-cache use, block size),
and the request latencies dashboards made for vLLM plot. docs/metrics.md maps each one to pagedserve's own
series (gateway/metrics.py, cache_service/metrics.py), which stay.

Every series has vLLM's labels: `model_name` (the served model's id, as GET /v1/models lists it) and `engine`
(vLLM numbers its engines from 0; a gateway runs one).
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway import lora

if TYPE_CHECKING:
    from gateway.engine import Engine

LABELS = ("model_name", "engine")
ENGINE = "0"

# vLLM's bucket layouts, in seconds, so that quantiles read the same on both servers.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

TTFT = Histogram(
    "vllm:time_to_first_token_seconds",
    "Seconds from a request's arrival to its first token.",
    LABELS,
    buckets=TTFT_BUCKETS,
)
ITL = Histogram(
    "vllm:inter_token_latency_seconds",
    "Seconds between two outputs of a request.",
    LABELS,
    buckets=ITL_BUCKETS,
)
E2E = Histogram(
    "vllm:e2e_request_latency_seconds",
    "Seconds from a request's arrival to its last token.",
    LABELS,
    buckets=REQUEST_BUCKETS,
)
QUEUE = Histogram(
    "vllm:request_queue_time_seconds",
    "Seconds a request waited from its arrival to its first scheduled step.",
    LABELS,
    buckets=REQUEST_BUCKETS,
)
SUCCESS = Counter("vllm:request_success", "Requests that finished, by reason.", [*LABELS, "finished_reason"])


class RequestSeries:
    """One request's observations, under its model's labels."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._ttft, self._itl = TTFT.labels(model, ENGINE), ITL.labels(model, ENGINE)

    def token(self, seconds: float, first: bool) -> None:
        (self._ttft if first else self._itl).observe(seconds)

    def finish(self, reason: str, e2e_s: float, queue_s: float) -> None:
        E2E.labels(self._model, ENGINE).observe(e2e_s)
        QUEUE.labels(self._model, ENGINE).observe(queue_s)
        SUCCESS.labels(self._model, ENGINE, reason).inc()


class EngineCollector(Collector):
    """The engine's state at scrape time (no samples until the gateway has attached to compute and cache).

    KV-cache usage counts what vLLM's does: the blocks held by block tables over all blocks, cached
    (evictable) blocks counted as free, as the cache service's last reply to this gateway said."""

    def __init__(self, engine: "Engine") -> None:
        self._engine = engine

    def collect(self) -> Iterator:
        engine = self._engine
        info, scheduler, kv = engine.model_info, engine.scheduler, engine.kv
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Sequences in the running batch.", labels=LABELS
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Sequences queued for their prefill.", labels=LABELS
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV blocks held by sequences / all blocks, 0 to 1 (cached, evictable blocks count as free).",
            labels=LABELS,
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Running sequences preempted for lack of KV blocks.", labels=LABELS
        )
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prompt tokens of new requests looked up in the prefix cache.",
            labels=LABELS,
        )  # fmt: skip
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prompt tokens of new requests found cached.", labels=LABELS
        )
        config = GaugeMetricFamily(
            "vllm:cache_config_info",
            "1, labelled with the KV cache's block size (tokens) and number of blocks.",
            labels=("block_size", "num_gpu_blocks", "engine"),
        )
        if info is not None and scheduler is not None and kv is not None:
            labels, totals = [info.model, ENGINE], engine.view.totals
            running.add_metric(labels, len(scheduler.running))
            waiting.add_metric(labels, len(scheduler.waiting))
            usage.add_metric(labels, 1 - kv.available_blocks / kv.num_blocks)
            preemptions.add_metric(labels, scheduler.num_preemptions)
            queries.add_metric(labels, totals.prompt_tokens)
            hits.add_metric(labels, totals.cached_tokens)
            config.add_metric([str(kv.block_size), str(kv.num_blocks), ENGINE], 1)
        yield from (running, waiting, usage, preemptions, queries, hits, config)
        yield lora.requests_info(info, scheduler)
