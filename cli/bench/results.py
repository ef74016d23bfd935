"""The files `pagedserve bench --json` wrote under a directory, and what was recorded with each: its own
`date`, `machine` and `vllm_binding` keys, else those `provenance.json` in its directory gives (what was
recorded beside files that lack them)."""

import json
from pathlib import Path

from cli.bench import report
from cli.bench.workloads import WORKLOADS

PROVENANCE = "provenance.json"


def load(root: Path) -> dict[Path, list[tuple[str, dict]]]:
    """Per directory under `root` (itself first, then its subdirectories in name order), its results as
    (path relative to `root`, result), in the bench's workload order and then by file name."""
    order = list(WORKLOADS)
    groups: dict[Path, list[tuple[str, dict]]] = {}
    for path in sorted(root.rglob("*.json"), key=lambda p: (p.parent != root, p.parent, p.name)):
        if path.name == PROVENANCE:
            continue
        result = json.loads(path.read_text())
        groups.setdefault(path.parent, []).append((path.relative_to(root).as_posix(), result))
    if not groups:
        raise ValueError(f"no bench JSON files under {root}")
    for results in groups.values():
        results.sort(key=lambda item: (_rank(item[1]["workload"], order), item[0]))
    return groups


def _rank(workload: str, order: list[str]) -> int:
    return order.index(workload) if workload in order else len(order)


def provenance(directory: Path) -> dict[str, dict]:
    path = directory / PROVENANCE
    return json.loads(path.read_text())["files"] if path.exists() else {}


def recorded(result: dict, provenance: dict) -> dict:
    """The file's date, machine, vLLM binding and any superseding note: its own keys, else its provenance."""
    keys = ("date", "machine", "vllm_binding", "superseded")
    own = {**result, "vllm_binding": result.get("vllm_binding") or _vllm_logged(result)}
    return {key: own.get(key) or provenance.get(key) for key in keys}


def _vllm_logged(result: dict) -> str | None:
    """What vLLM's own log said of its binding (the bench keeps those lines), e.g. `core ids=[0, 1]`."""
    log = result.get("peer_settings", {}).get(report.FIRST, {}).get("binding_log") or []
    said = [
        line.rsplit("\t", 1)[-1].strip() for line in log if "core ids=" in line or "reserved_cpus=" in line
    ]
    return f"vLLM logged {', '.join(said)}" if said else None
