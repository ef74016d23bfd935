"""Where each scheduler step's time goes: the gateway's own phases and compute's split of its Forward."""

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Histogram

from common.metrics import LATENCY_BUCKETS
from protos import compute_pb2

STEP_SECONDS = Histogram(
    "pagedserve_step_duration_seconds",
    "One scheduler step as the gateway sees it: scheduling, cache and compute calls, token handling.",
    ["kind"],
    buckets=LATENCY_BUCKETS,
)
PHASE_SECONDS = Histogram(
    "pagedserve_step_phase_seconds",
    "Part of one scheduler step: gateway phases (schedule, cache_rpc, compute_rpc) and, from compute's "
    "reply, its own split (compute_prepare, compute_model, compute_attention, compute_sample).",
    ["kind", "phase"],
    buckets=LATENCY_BUCKETS,
)
GATEWAY_PHASES = ("schedule", "cache_rpc", "compute_rpc")
COMPUTE_PHASES = ("prepare", "model", "attention", "sample")


class StepTimer:
    """Sums the time of each named phase of one step; `finish` records them with the step's wall time."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases = dict.fromkeys(GATEWAY_PHASES, 0.0)
        self.compute: compute_pb2.ForwardResponse | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] += time.perf_counter() - start

    def finish(self, kind: str) -> float:
        """kind: 'prefill' or 'decode'. Returns the step's wall time in seconds."""
        seconds = time.perf_counter() - self.start
        STEP_SECONDS.labels(kind).observe(seconds)
        for name, phase_s in self.phases.items():
            PHASE_SECONDS.labels(kind, name).observe(phase_s)
        if self.compute is not None:
            for name in COMPUTE_PHASES:
                ms = getattr(self.compute, f"{name}_ms")
                PHASE_SECONDS.labels(kind, f"compute_{name}").observe(ms / 1e3)
        return seconds
