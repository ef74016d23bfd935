"""`bench --profile`: the gateway's step histograms read before and after a run, as mean ms per phase."""

from cli.bench.report import aligned
from cli.scrape import Samples
from gateway.step_timer import COMPUTE_PHASES, GATEWAY_PHASES

PHASES = (*GATEWAY_PHASES, *(f"compute_{name}" for name in COMPUTE_PHASES))
KINDS = ("decode", "prefill")
# The model's own work inside compute; whatever else a step spends is orchestration overhead.
FORWARD = ("compute_model", "compute_sample")
STEP_HISTOGRAMS = ("pagedserve_step_duration_seconds", "pagedserve_step_phase_seconds")

Totals = dict[tuple[str, str], tuple[float, float]]  # (kind, phase or "step") -> (sum of seconds, count)


def totals(samples: Samples) -> Totals:
    """Sums and counts of the step histograms among scraped samples."""
    result: Totals = {}
    for (name, labels), value in samples.items():
        family, _, field = name.rpartition("_")
        if family not in STEP_HISTOGRAMS or field not in ("sum", "count"):
            continue
        labels = dict(labels)
        key = (labels.get("kind"), labels.get("phase", "step"))
        seconds, count = result.get(key, (0.0, 0.0))
        result[key] = (value, count) if field == "sum" else (seconds, value)
    return result


def summarize(before: Totals, after: Totals) -> dict:
    """Per step kind: steps, mean ms of the whole step and of each phase, each phase's share of the step,
    and the orchestration overhead (step wall - the model's forward and sampling inside compute)."""
    result = {}
    for kind in KINDS:
        steps, wall = _delta(before, after, kind, "step")
        if not steps:
            continue
        phases = {phase: 1e3 * _delta(before, after, kind, phase)[1] / steps for phase in PHASES}
        step_ms = 1e3 * wall / steps
        overhead_ms = step_ms - sum(phases[phase] for phase in FORWARD)
        result[kind] = {
            "steps": steps,
            "step_ms": step_ms,
            "phases_ms": phases,
            "overhead_ms": overhead_ms,
            "overhead_pct": 100 * overhead_ms / step_ms,
        }
    return result


def _delta(before: Totals, after: Totals, kind: str, phase: str) -> tuple[int, float]:
    """(steps, seconds) between the two scrapes."""
    seconds0, count0 = before.get((kind, phase), (0.0, 0.0))
    seconds1, count1 = after.get((kind, phase), (0.0, 0.0))
    return round(count1 - count0), seconds1 - seconds0


def table(profile: dict) -> str:
    kinds = [kind for kind in KINDS if kind in profile]
    if not kinds:
        return "profile: no steps recorded"
    rows = [["phase (mean ms per step)", *(f"{kind} ms" for kind in kinds), *(f"{kind} %" for kind in kinds)]]
    for phase in PHASES:
        ms = [profile[kind]["phases_ms"][phase] for kind in kinds]
        shares = [100 * m / profile[kind]["step_ms"] for m, kind in zip(ms, kinds, strict=True)]
        rows.append([phase, *(f"{m:.2f}" for m in ms), *(f"{p:.1f}" for p in shares)])
    rows.append(
        ["step (wall, gateway)", *(f"{profile[k]['step_ms']:.2f}" for k in kinds), *("100.0" for _ in kinds)]
    )
    rows.append(
        ["orchestration overhead", *(f"{profile[k]['overhead_ms']:.2f}" for k in kinds),
         *(f"{profile[k]['overhead_pct']:.1f}" for k in kinds)]
    )  # fmt: skip
    rows.append(["steps", *(str(profile[k]["steps"]) for k in kinds), *("" for _ in kinds)])
    note = (
        "overhead = step wall - (compute_model + compute_sample); compute_attention is part of compute_model"
    )
    return "\n".join(["step profile:", *aligned(rows), note])
