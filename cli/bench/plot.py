"""`pagedserve bench-plot RESULT.json... --output PNG`: tokens/s and inter-token latency per workload, every
engine side by side, from the files `pagedserve bench --json` wrote (also `python -m cli.bench.plot`)."""

import argparse
import json
import sys
from pathlib import Path

from cli.bench import report
from cli.bench.workloads import WORKLOADS

ENGINES = ("pagedserve", report.FIRST, *report.PEERS)
PANELS = (("tokens_per_s", "tokens/s (prompt + generated), higher is better"),
          ("itl_p50_ms", "inter-token latency p50 (ms), lower is better"))  # fmt: skip
COLOURS = {
    "pagedserve": "#1f77b4",
    report.FIRST: "#d62728",
    "generate_batch": "#2ca02c",
    "generate": "#9a9a9a",
}
DEFAULT_OUTPUT = Path("docs/bench/performance.png")


def series(results: list[dict]) -> tuple[list[str], dict[str, dict[str, list[float | None]]]]:
    """The workloads in the bench's order and, per panel figure and engine, one value per workload (None
    where that engine has no such figure). ValueError for two results of one workload."""
    by_name = {}
    for result in results:
        if result["workload"] in by_name:
            raise ValueError(f"two results for workload {result['workload']!r}: give one file per workload")
        by_name[result["workload"]] = result
    names = sorted(by_name, key=lambda n: list(WORKLOADS).index(n) if n in WORKLOADS else len(WORKLOADS))
    values = {
        key: {engine: [_figure(by_name[n], engine, key) for n in names] for engine in ENGINES}
        for key, _ in PANELS
    }
    return names, values


def _figure(result: dict, engine: str, key: str) -> float | None:
    figures = result["pagedserve"] if engine == "pagedserve" else result.get("peers", {}).get(engine, {})
    return figures.get(key)


def draw(results: list[dict], output: Path, title: str) -> None:
    """Writes the PNG: one panel per figure, a group of bars per workload, a bar per engine that has it."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    names, values = series(results)
    figure, axes = pyplot.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.5))
    width = 0.8 / len(ENGINES)
    for axis, (key, label) in zip(axes, PANELS, strict=True):
        for i, engine in enumerate(ENGINES):
            points = [(x, v) for x, v in enumerate(values[key][engine]) if v is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                bars = axis.bar([x + (i - (len(ENGINES) - 1) / 2) * width for x in xs], ys, width,
                                label=engine, color=COLOURS[engine])  # fmt: skip
                axis.bar_label(bars, fmt="%.0f", fontsize=7)
        axis.set_xticks(range(len(names)), names, rotation=20)
        axis.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: no metadata (matplotlib's version, a date): the same JSON files give the same bytes.
    figure.savefig(output, dpi=100, metadata={"Software": None})
    pyplot.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", type=Path, help="files written by `pagedserve bench --json`")
    parser.add_argument(
        "--output", type=Path, default=DEFAULT_OUTPUT, help=f"the PNG (default: {DEFAULT_OUTPUT})"
    )
    parser.add_argument("--title", default="pagedserve vs vLLM CPU vs transformers, per workload")


def add_parser(commands) -> None:
    p = commands.add_parser("bench-plot")
    add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        results = [json.loads(path.read_text()) for path in args.results]
        draw(results, args.output, args.title)
    except (OSError, ValueError, KeyError) as error:
        raise SystemExit(f"pagedserve bench-plot: {error}") from error
    print(args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.bench.plot", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
