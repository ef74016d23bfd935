"""The gateway's Prometheus metrics: request latencies as clients see them, and the scheduler's queues."""

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from common.metrics import LATENCY_BUCKETS
from gateway import model_server_metrics
from gateway.scheduler import Scheduler

if TYPE_CHECKING:
    from gateway.engine import Engine

TTFT = Histogram(
    "pagedserve_time_to_first_token_seconds",
    "From a request's arrival to its first generated token.",
    buckets=LATENCY_BUCKETS,
)
ITL = Histogram(
    "pagedserve_inter_token_latency_seconds", "Between tokens of a request.", buckets=LATENCY_BUCKETS
)
QUEUE = Histogram(
    "pagedserve_request_queue_time_seconds",
    "From a request's arrival to its first scheduled step.",
    buckets=LATENCY_BUCKETS,
)
E2E = Histogram("pagedserve_e2e_request_latency_seconds", "Arrival to last token.", buckets=LATENCY_BUCKETS)
FINISHED = Counter("pagedserve_requests_finished", "Requests completed, by reason.", ["finish_reason"])
PROMPT_TOKENS = Counter("pagedserve_prompt_tokens", "Prompt tokens of finished requests.")
GENERATION_TOKENS = Counter("pagedserve_generation_tokens", "Tokens generated for finished requests.")
RESUMED = Counter(
    "pagedserve_requests_resumed", "Requests that continue a broken stream (GenerateRequest.resume)."
)


class RequestTimer:
    """Observes one request's TTFT, inter-token latencies and end-to-end latency as its tokens are sent, in
    pagedserve's series and in vLLM's (under the served model's name)."""

    def __init__(self, model: str) -> None:
        self.start = self.last = time.monotonic()
        self.tokens = 0
        self._vllm = model_server_metrics.RequestSeries(model)

    def token(self) -> float:
        """Observes a token sent now; returns now."""
        now = time.monotonic()
        (ITL if self.tokens else TTFT).observe(now - self.last)
        self._vllm.token(now - self.last, first=not self.tokens)
        self.last, self.tokens = now, self.tokens + 1
        return now

    def finish(self, reason: str, prompt_tokens: int, queue_s: float) -> None:
        e2e = time.monotonic() - self.start
        E2E.observe(e2e)
        QUEUE.observe(queue_s)
        self._vllm.finish(reason, e2e, queue_s)
        FINISHED.labels(reason).inc()
        PROMPT_TOKENS.inc(prompt_tokens)
        GENERATION_TOKENS.inc(self.tokens)


class SchedulerCollector(Collector):
    """Running and waiting requests and preemptions, read from the scheduler at scrape time."""

    def __init__(self, get_scheduler: Callable[[], Scheduler | None]) -> None:
        self._get_scheduler = get_scheduler

    def collect(self) -> Iterator:
        scheduler = self._get_scheduler()
        running, waiting = (len(scheduler.running), len(scheduler.waiting)) if scheduler else (0, 0)
        yield GaugeMetricFamily("pagedserve_requests_running", "Requests in the running batch.", running)
        yield GaugeMetricFamily("pagedserve_requests_waiting", "Requests queued for a prefill.", waiting)
        yield CounterMetricFamily(
            "pagedserve_preemptions",
            "Running requests preempted (blocks freed, recomputed later) for lack of KV blocks.",
            scheduler.num_preemptions if scheduler else 0,
        )


def register(engine: "Engine") -> None:
    """The engine's series, pagedserve's and vLLM's, read at scrape time."""
    REGISTRY.register(SchedulerCollector(lambda: engine.scheduler))
    REGISTRY.register(model_server_metrics.EngineCollector(engine))
