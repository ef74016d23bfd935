"""The README's performance table, made from the files `pagedserve bench --json` wrote (with
docs/performance.md, by `make docs`: `python -m cli.bench.page docs/bench --out docs/performance.md --readme
README.md`): every workload of the top directory that ran vLLM, then every run under it that ran llama.cpp
(the quantised ones), one row each, pagedserve / peer in each cell; a superseded file is left out. It
replaces the text between the README's two markers."""

from pathlib import Path

from cli.bench import report, results

BEGIN = "<!-- performance table: made by `make docs` from docs/bench/*.json; edit those, not this -->"
END = "<!-- end of the performance table -->"


def table(root: Path) -> str:
    """The README's tables: the workloads of `root` that ran vLLM, then the runs under it that ran llama.cpp
    (the quantised ones), one row each: pagedserve / peer for tokens/s (with the ratio), generated and
    prompt tokens/s, TTFT p50 and inter-token p50 and p99. What a table's rows share (date, machine, setups)
    is said once above it; the parts that differ get a column."""
    tables = [_peer_table(rows) for rows in _runs_by_peer(root) if rows]
    if not tables:
        raise ValueError(f"no bench JSON file under {root} ran vLLM or llama.cpp")
    intro = (
        "Each cell is pagedserve / peer, each row one `pagedserve bench --json` file under `docs/bench/`; "
        "the ratio is pagedserve ÷ peer on tokens/s (above 1: pagedserve ahead). *tokens/s* counts every "
        "token of the run, prompt and generated, prompt tokens read from the prefix cache included, over its "
        "wall time; *generated tokens/s* counts only the new tokens; *prompt tokens/s* only the prompt "
        "tokens each engine computed."
    )
    return "\n\n".join([f"{BEGIN}\n{intro}", *tables]) + f"\n{END}"


def _runs_by_peer(root: Path) -> tuple[list, list]:
    """(peer, result, recorded) of every file that is not superseded: vLLM's from `root` itself, llama.cpp's
    from its subdirectories."""
    by_peer: dict[str, list] = {report.FIRST: [], report.LLAMACPP: []}
    for directory, files in results.load(root).items():
        provenance = results.provenance(directory)
        peer = report.FIRST if directory == root else report.LLAMACPP
        for path, result in files:
            recorded = results.recorded(result, provenance.get(Path(path).name, {}))
            # NOTE: a race through a real client (`bench --client`) has figures per concurrency: no row
            if not recorded["superseded"] and peer in result.get("peers", {}) and "client" not in result:
                by_peer[peer].append((peer, result, recorded))
    return by_peer[report.FIRST], by_peer[report.LLAMACPP]


def _peer_table(rows: list) -> str:
    peer = rows[0][0]
    setup_key = "vllm_setup" if peer == report.FIRST else "llamacpp_setup"
    facts = {
        "measured": [
            f"{(rec['date'] or 'date not recorded')[:10]} on {rec['machine'] or 'machine not recorded'}"
            for _, _, rec in rows
        ],
        "pagedserve": [result["setup"] for _, result, _ in rows],
        peer: [result.get(setup_key) or "not recorded" for _, result, _ in rows],
    }
    said, columns = [], {}
    for name, values in facts.items():
        common, own = _common_parts(values)
        if common:
            said.append(f"- {name}: {common}")
        if any(own):
            columns[name] = own
    header = [
        "workload",
        *columns,
        "tokens/s",
        "generated tokens/s",
        "prompt tokens/s",
        "TTFT p50",
        "inter-token p50",
        "inter-token p99",
    ]
    lines = []
    for i, (_, result, _) in enumerate(rows):
        ours, theirs = result["pagedserve"], result["peers"][peer]
        speed = report.ratio(ours.get("tokens_per_s"), theirs.get("tokens_per_s"), "tokens_per_s")
        lines.append(
            [
                f"{result['workload']}: {result['description']}",
                *(own[i] for own in columns.values()),
                _pair(ours, theirs, "tokens_per_s", _count) + ("" if speed is None else f" ({speed:.2f}×)"),
                _pair(ours, theirs, "generated_tokens_per_s", _count),
                _pair(ours, theirs, "prompt_tokens_per_s", _count),
                _pair(ours, theirs, "ttft_p50_ms", _duration),
                _pair(ours, theirs, "itl_p50_ms", _duration),
                _pair(ours, theirs, "itl_p99_ms", _duration),
            ]
        )
    table = ["| " + " | ".join(cells) + " |" for cells in [header, ["---"] * len(header), *lines]]
    return "\n".join([f"Against {peer}:", "", *said, "", *table])


def _common_parts(values: list[str]) -> tuple[str, list[str]]:
    """The comma-separated parts every value has (in the first's order), and each value's other parts; a
    comma inside parentheses does not separate parts."""
    parts = [_parts(value) for value in values]
    common = [part for part in parts[0] if all(part in other for other in parts[1:])]
    return ", ".join(common), [", ".join(p for p in own if p not in common) for own in parts]


def _parts(value: str) -> list[str]:
    """`value` split at each ", " outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(value):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and value.startswith(", ", i):
            parts.append(value[start:i])
            start = i + 2
    return [*parts, value[start:]]


def _pair(ours: dict, theirs: dict, key: str, fmt) -> str:
    return f"{fmt(ours.get(key))} / {fmt(theirs.get(key))}"


def _count(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _duration(ms) -> str:
    if ms is None:
        return "-"
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def with_table(readme: str, table: str) -> str:
    """`readme` with the text between its two markers (the markers included) replaced by `table`."""
    begin, end = readme.find(BEGIN), readme.find(END)
    if begin < 0 or end < begin:
        raise ValueError(f"the README has no performance table markers ({BEGIN!r} … {END!r})")
    return readme[:begin] + table + readme[end + len(END) :]
