"""The soak's figures from what it recorded: which requests ended identical to the fault-free run, latency
around the faults and away from them, each service's memory over the run, and when to kill what."""

import math
import random
from collections import Counter
from dataclasses import dataclass, field

from cli.bench.driver import percentile

MIB = 2**20


@dataclass
class Fault:
    """One kill: the service, its pid, when (perf_counter seconds) it was killed and when the stack served
    again (None: not within the soak's wait)."""

    service: str
    pid: int
    at: float
    back: float | None = None


@dataclass(slots=True)
class Run:
    """One request of the soak: which workload request it sent, when, its tokens and their arrival times,
    the breaks its stream resumed after, and its error (a gRPC status name) if it failed."""

    index: int
    sent: float
    ended: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    resumes: int = 0
    error: str | None = None


def kill_schedule(rng: random.Random, services: list[str], duration_s: float, every_s: float) -> list:
    """(seconds after the start, service) of each kill: every `every_s` before `duration_s` has passed, each
    service drawn at random."""
    count = math.ceil(duration_s / every_s) - 1
    return [(every_s * k, rng.choice(services)) for k in range(1, count + 1)]


def around(run: Run, faults: list[Fault]) -> bool:
    """Whether the request was running while the stack was down or coming back from a fault: its span from
    sending to its last token overlaps some fault's span from the kill to serving again."""
    end = run.ended or run.sent
    return any(run.sent <= (fault.back or fault.at) and fault.at <= end for fault in faults)


def latency(runs: list[Run]) -> dict:
    """TTFT and inter-token latency percentiles (ms) of these requests, as their clients saw them."""
    timed = [r for r in runs if r.token_times]
    ttft = [r.token_times[0] - r.sent for r in timed]
    itl = [b - a for r in timed for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    return {
        "requests": len(runs),
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)),
        "itl_p99_ms": _ms(percentile(itl, 99)),
        "itl_max_ms": _ms(max(itl, default=float("nan"))),
    }


def outcomes(runs: list[Run], reference: dict[int, list[int]]) -> dict:
    """How the requests ended: completed (no error), of those identical to the fault-free run's tokens,
    failed by status, and how many streams resumed after a break."""
    done = [r for r in runs if r.error is None]
    identical = sum(r.token_ids == reference[r.index] for r in done)
    return {
        "sent": len(runs),
        "completed": len(done),
        "identical": identical,
        "different": len(done) - identical,
        "failed": len(runs) - len(done),
        "failures": dict(Counter(r.error for r in runs if r.error is not None)),
        "resumed": sum(r.resumes > 0 for r in runs),
    }


def fault_figures(faults: list[Fault], runs: list[Run], start: float) -> list[dict]:
    """Per fault: the service, when it was killed (seconds into the soak), how long until the stack served
    again, and until some stream received its next token."""
    result = []
    for fault in faults:
        later = [t for r in runs for t in r.token_times if t > fault.at]
        result.append(
            {
                "service": fault.service,
                "at_s": round(fault.at - start, 3),
                "back_s": None if fault.back is None else round(fault.back - fault.at, 3),
                "next_token_s": round(min(later) - fault.at, 3) if later else None,
            }
        )
    return result


def memory(samples: dict[str, list[tuple[int, int]]]) -> dict:
    """Per service, from its (pid, RSS bytes) samples in order: RSS at the first and the last sample, the
    growth between them and the peak (MiB), and how many processes it ran as (restarts + 1)."""
    result = {}
    for name, seen in samples.items():
        if not seen:
            continue
        first, last = seen[0][1], seen[-1][1]
        result[name] = {
            "rss_start_mib": round(first / MIB, 1),
            "rss_end_mib": round(last / MIB, 1),
            "rss_growth_mib": round((last - first) / MIB, 1),
            "rss_peak_mib": round(max(rss for _, rss in seen) / MIB, 1),
            "processes": len(dict.fromkeys(pid for pid, _ in seen)),
        }
    return result


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 1)
