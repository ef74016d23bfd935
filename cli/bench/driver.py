"""Sends a workload through the public API and times every token as the client sees it."""

import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cli.bench.workloads import BenchRequest, Workload
from common.server import channel
from protos import cache_pb2, cache_pb2_grpc
from sdk.client import Client

# Figures that only pagedserve's cache service reports (None for the peers).
CACHE_ONLY = (
    "peak_sequences",
    "peak_used_blocks",
    "kv_utilisation_mean",
    "kv_utilisation_at_peak",
    "tier_hit_blocks",
    "tier_load_ms_per_block",
)


@dataclass(slots=True)
class Trace:
    sent: float
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class CacheSample:
    used_blocks: int
    num_sequences: int
    stored_tokens: int = 0
    table_slots: int = 0
    time: float = 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _send(client: Client, request: BenchRequest, start: float, on_token, salt: str) -> Trace:
    time.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    trace = Trace(sent=time.perf_counter())
    for chunk in client.stream(token_ids=request.prompt_ids, max_tokens=request.max_tokens, temperature=0.0,
                               ignore_eos=True, cache_salt=salt):  # fmt: skip
        now = time.perf_counter()
        trace.token_times.extend([now] * len(chunk.token_ids))
        on_token(len(chunk.token_ids))
        if chunk.usage is not None:
            trace.prompt_tokens = chunk.usage.prompt_tokens
            trace.cached_tokens = chunk.usage.cached_tokens
            trace.completion_tokens = chunk.usage.completion_tokens
    return trace


def _sample_cache(cache_target: str, stop: threading.Event, samples: list[CacheSample]) -> None:
    stub = cache_pb2_grpc.CacheStub(channel(cache_target))
    while not stop.wait(0.05):
        stats = stub.GetStats(cache_pb2.GetStatsRequest(), timeout=5)
        samples.append(
            CacheSample(
                stats.used_blocks,
                stats.num_sequences,
                stats.stored_tokens,
                stats.table_slots,
                time.perf_counter(),
            )
        )


def run(
    workload: Workload, target: str, cache_target: str, on_token=lambda n: None, salt: str | None = None
) -> dict:
    """Figures of one pass of the workload: throughput, TTFT and inter-token latency, cache occupancy.

    NOTE: each pass has a cache salt of its own (unless given), so that a repeated pass computes its prompts
    again instead of finding the previous pass's blocks (requests of one pass still share prefixes). A pass
    given an earlier pass's salt finds its prefixes, in the pool or in a KV tier.
    """
    salt = salt or uuid.uuid4().hex
    samples: list[CacheSample] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_cache, args=(cache_target, stop, samples), daemon=True)
    cache = cache_pb2_grpc.CacheStub(channel(cache_target))
    before = cache.GetStats(cache_pb2.GetStatsRequest(), timeout=5)
    with Client(target) as client, ThreadPoolExecutor(len(workload.requests)) as pool:
        sampler.start()
        start = time.perf_counter()
        traces = list(pool.map(lambda r: _send(client, r, start, on_token, salt), workload.requests))
    stop.set()
    sampler.join()
    after = cache.GetStats(cache_pb2.GetStatsRequest(), timeout=5)
    return {**summarize(traces, samples), **tier_loads(before, after)}


def tier_loads(before: cache_pb2.CacheStats, after: cache_pb2.CacheStats) -> dict:
    """The prompt blocks the cache's KV tier loaded between two GetStats, and the milliseconds per block
    (None without a tier, or when it loaded none)."""
    if not after.HasField("kv_tier"):
        return {"tier_hit_blocks": None, "tier_load_ms_per_block": None}
    hits = after.kv_tier.hit_blocks - before.kv_tier.hit_blocks
    seconds = after.kv_tier.load_seconds - before.kv_tier.load_seconds
    return {"tier_hit_blocks": hits, "tier_load_ms_per_block": 1e3 * seconds / hits if hits else None}


def summarize(traces: list[Trace], samples: list[CacheSample]) -> dict:
    """The traces' timings and the cache's occupancy over the run."""
    return {
        **timings(traces),
        "peak_sequences": max((s.num_sequences for s in samples), default=0),
        "peak_used_blocks": max((s.used_blocks for s in samples), default=0),
        **kv_utilisation(samples),
    }


def check_complete(engine: str, workload: Workload, traces: list[Trace]) -> list[Trace]:
    """The traces of one pass; ValueError unless there is one per request, each with exactly its max_tokens
    (ignore_eos), every token timed."""
    if len(traces) != len(workload.requests):
        raise ValueError(f"{engine} answered {len(traces)} of {len(workload.requests)} requests")
    for i, (request, trace) in enumerate(zip(workload.requests, traces, strict=True)):
        if trace.completion_tokens != request.max_tokens or len(trace.token_times) != request.max_tokens:
            raise ValueError(
                f"{engine} request {i}: {trace.completion_tokens} tokens, {len(trace.token_times)} times, "
                f"max_tokens {request.max_tokens}"
            )
    return traces


def timings(traces: list[Trace]) -> dict:
    """Throughput, TTFT and inter-token latency as the clients saw them (the same code for every engine that
    streams tokens: pagedserve and the vLLM peer)."""
    first_sent = min(t.sent for t in traces)
    wall = max(t.token_times[-1] for t in traces) - first_sent
    prompt = sum(t.prompt_tokens for t in traces)
    generated = sum(t.completion_tokens for t in traces)
    ttft = [t.token_times[0] - t.sent for t in traces]
    itl = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    prefill_span = max(t.token_times[0] for t in traces) - first_sent
    return {
        "requests": len(traces),
        "wall_s": wall,
        "tokens_per_s": (prompt + generated) / wall,
        "generated_tokens_per_s": generated / wall,
        "prompt_tokens_per_s": (prompt - sum(t.cached_tokens for t in traces)) / prefill_span,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": sum(t.cached_tokens for t in traces),
        "generated_tokens": generated,
        # the keys the computed prompt tokens attend to, in all: token t of a prompt attends to t + 1
        "prompt_attention_keys": sum(_keys(t.prompt_tokens) - _keys(t.cached_tokens) for t in traces),
    }


def _keys(tokens: int) -> int:
    """The keys the first `tokens` tokens of a prompt attend to, in all."""
    return tokens * (tokens + 1) // 2


def kv_utilisation(samples: list[CacheSample]) -> dict:
    """Tokens stored / token slots allocated: its mean over the run, each sample weighted by the time until
    the next one (samples with no table held left out), and its value when the tables held the most slots."""
    held = [(a, b.time - a.time) for a, b in zip(samples, samples[1:], strict=False) if a.table_slots]
    if not held:
        return {"kv_utilisation_mean": None, "kv_utilisation_at_peak": None}
    peak = max((s for s, _ in held), key=lambda s: s.table_slots)
    weight = sum(dt for _, dt in held)
    mean = sum(s.stored_tokens / s.table_slots * dt for s, dt in held) / weight if weight else None
    return {"kv_utilisation_mean": mean, "kv_utilisation_at_peak": peak.stored_tokens / peak.table_slots}


def median_of(runs: list[dict]) -> dict:
    """Per figure, the median over runs that have it (None if none has)."""
    medians = {}
    for key in runs[0]:
        values = [run[key] for run in runs if run[key] is not None]
        medians[key] = statistics.median(values) if values else None
    return medians
