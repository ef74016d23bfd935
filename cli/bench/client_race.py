"""`pagedserve bench --client vllm`: pagedserve's HTTP API and vLLM's OpenAI server raced by vLLM's own
benchmark client (`vllm bench serve`), as a user measures a server: HTTP, tokenisation and detokenisation
included on both sides.

The bench starts a stack (`pagedserve up`, its flags as for any workload) and runs the client against its
/v1/completions: one warm-up run, then each --concurrency in turn (each --repeat times, medians kept); the
stack stops; then vLLM's server (cli/bench/vllm_server.py: the same model directory and dtype,
--vllm-kv-memory, bound as --vllm-bind says, prefix caching on) gets the same runs, prompts and seeds
(skipped by --no-peers).
"""

import argparse
import functools
import os
import sys
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from cli.bench import binding, client_runs, report, vllm_peer, vllm_server
from cli.bench.client_runs import Shape
from cli.processes import children_of, cpu_seconds, services_of
from common.cpu import describe
from common.model_files import local_copy
from sdk.client import Client

NAME = "http-client"
CLIENTS = {"vllm": "vLLM's benchmark client (`vllm bench serve`, vllm.benchmarks.serve)"}
CONCURRENCY = (1, 4, 16)
# A server's processes to read the CPU of, by name (one name may stand for several).
Processes = Callable[[], dict[str, list[int]]]
# The figure of the CPU seconds a process (named after the prefix) spent in a run.
CPU_PREFIX = "cpu_s_"
# The figures of each concurrency, as the tables show them.
ROWS = [
    ("total_tokens_per_s", "total tokens/s", "{:.0f}"),
    ("ttft_p50_ms", "TTFT median (ms)", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 (ms)", "{:.0f}"),
    ("itl_p50_ms", "inter-token median (ms)", "{:.1f}"),
    ("itl_p99_ms", "inter-token p99 (ms)", "{:.1f}"),
    ("tpot_p50_ms", "time per output token median (ms)", "{:.1f}"),
]


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--client", choices=list(CLIENTS),
        help="instead of a --workload: race pagedserve's HTTP API and vLLM's OpenAI server (from "
        "--vllm-python; --no-peers: pagedserve only) with this benchmark client (vllm: `vllm bench serve`, "
        "from the same venv)",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=list(CONCURRENCY), metavar="N",
        help="with --client: the client's --max-concurrency of each run (default: 1 4 16)",
    )  # fmt: skip
    parser.add_argument(
        "--client-prompts", type=int, default=Shape.prompts, metavar="N",
        help=f"with --client: prompts per run (default {Shape.prompts}, of {Shape.input_len} tokens + "
        f"{Shape.output_len} new)",
    )  # fmt: skip


def check_flags(args: argparse.Namespace) -> None:
    """SystemExit unless exactly one of --workload and --client is given, and --client has vLLM's interpreter
    (--vllm-python, else $PAGEDSERVE_VLLM_PYTHON: read now and put into args) and a stack of its own."""
    if bool(args.workload) == bool(args.client):
        raise SystemExit("pagedserve bench: give --workload NAME or --client NAME (one of them)")
    if not args.client:
        return
    args.vllm_python = args.vllm_python or os.environ.get(vllm_peer.PYTHON_ENV)
    if not args.vllm_python:
        raise SystemExit(
            f"pagedserve bench: --client vllm needs --vllm-python PATH (or ${vllm_peer.PYTHON_ENV})"
        )
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"pagedserve bench: --vllm-python {args.vllm_python}: no such file")
    for flag, given in (("--target", args.target), ("--peer", args.peer), ("--profile", args.profile)):
        if given:
            raise SystemExit(f"pagedserve bench: {flag} does not go with --client (it starts both servers)")
    if min(args.concurrency) < 1 or args.client_prompts < 1:
        raise SystemExit("pagedserve bench: --concurrency and --client-prompts must be at least 1")


def runs(base_url: str, model_dir: Path, served: str, args: argparse.Namespace) -> list[list[str]]:
    """The client's runs against one server: a warm-up (as many prompts as the largest concurrency, all at
    once, seed --seed), then every concurrency --repeat times over, each run on a seed of its own."""
    shape, top = Shape(args.client_prompts), max(args.concurrency)
    warm_up = client_runs.argv(base_url, model_dir, served, top, args.seed, Shape(top, shape.input_len, 4))
    measured = [
        client_runs.argv(base_url, model_dir, served, c, args.seed + 1 + r * len(args.concurrency) + i, shape)
        for r in range(args.repeat)
        for i, c in enumerate(args.concurrency)
    ]
    return [warm_up, *measured]


def figures(results: list[dict], args: argparse.Namespace) -> dict[str, dict]:
    """Per concurrency (its number as text), the median figures of its runs: the client's results of the
    measured `runs` in order, each with the CPU seconds each of the server's processes spent in it
    ("cpu_seconds", figures `cpu_s_NAME`)."""
    shape, count = Shape(args.client_prompts), len(args.concurrency)

    def one(result: dict) -> dict:
        spent = {f"{CPU_PREFIX}{name}": seconds for name, seconds in result["cpu_seconds"].items()}
        return {**client_runs.figures(result, shape), **spent}

    return {
        str(c): client_runs.median_of([one(results[r * count + i]) for r in range(args.repeat)])
        for i, c in enumerate(args.concurrency)
    }


def _measure(
    base_url: str, model_dir: Path, served: str, args: argparse.Namespace, who: str, processes: Processes
) -> tuple[dict, str]:
    """The server's figures per concurrency and the client's version: the warm-up, then each measured run
    by a client of its own, the CPU of the server's processes (`processes()`) read around it."""
    print(f"{NAME}: {who}, concurrency {', '.join(map(str, args.concurrency))}", file=sys.stderr)
    warm_up, *measured = runs(base_url, model_dir, served, args)
    version = client_runs.run(args.vllm_python, [warm_up]).get("vllm_version")
    results = []
    for argv in measured:
        tree = processes()
        before = {name: sum(map(cpu_seconds, pids)) for name, pids in tree.items()}
        result = client_runs.run(args.vllm_python, [argv])["results"][0]
        spent = {name: sum(map(cpu_seconds, pids)) - before[name] for name, pids in tree.items()}
        results.append({**result, "cpu_seconds": spent})
    return figures(results, args), version


def _services(up_pid: int) -> dict[str, list[int]]:
    """A stack's services (cache, compute, gateway), by the pid of its `pagedserve up`."""
    return {name: [pid] for name, pid in services_of(up_pid).items()}


def _vllm_processes(pid: int) -> dict[str, list[int]]:
    """vLLM's server: its API server process, and the processes it started (its engine core)."""
    return {"api server": [pid], "engine": children_of(pid)}


def run(args: argparse.Namespace, start) -> dict:
    """The race: pagedserve on a stack `start()` starts, then vLLM's server unless --no-peers."""
    model_dir, shape = local_copy(args.model).path, Shape(args.client_prompts)
    stack = start()
    try:
        with Client(stack.target) as client:
            info = client.info()
        base_url = stack.http_url.removesuffix("/v1")
        services = functools.partial(_services, stack.proc.pid)
        ours, version = _measure(base_url, model_dir, info.model, args, "pagedserve", services)
    finally:
        stack.stop()
    levels = ", ".join(map(str, args.concurrency))
    result = {
        "workload": NAME,
        "description": f"{CLIENTS[args.client]} over HTTP: random dataset, {shape.prompts} prompts of "
        f"{shape.input_len} tokens + {shape.output_len} new (ignore_eos, temperature 0), "
        f"{client_runs.ENDPOINT} streamed, at concurrency {levels}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": describe(),
        "client": {"name": args.client, "version": version, "concurrency": args.concurrency, **vars(shape)},
        "setup": f"pagedserve up: {info.model}, {info.dtype}, KV {info.kv_dtype}, block size "
        f"{info.block_size}, prefix cache on, its HTTP API; each concurrency median of {args.repeat}, after "
        "one warm-up run",
        "pagedserve": ours,
    }
    if not args.no_peers:
        _race_vllm(args, result, model_dir, info)
    return result


def _race_vllm(args: argparse.Namespace, result: dict, model_dir: Path, info) -> None:
    """vLLM's server's figures, how it ran and the ratios into `result`; a server that fails is reported
    there (`peer_error`) and on stderr, pagedserve's figures kept."""
    dtype = args.vllm_dtype or info.dtype
    shape = Shape(args.client_prompts)
    model_len = max(vllm_peer.MIN_MODEL_LEN, shape.input_len + shape.output_len)
    print(f"{NAME}: starting vLLM's server (it compiles for ~2 minutes at each start)", file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory(prefix="pagedserve-bench-vllm-server-") as workdir:
            log = Path(workdir) / "vllm-server.log"
            with vllm_server.server(
                args.vllm_python, model_dir, info.model, dtype, args.vllm_kv_memory, model_len,
                args.vllm_bind, log,
            ) as (base_url, pid):  # fmt: skip
                tree = functools.partial(_vllm_processes, pid)
                theirs, version = _measure(base_url, model_dir, info.model, args, "vLLM's server", tree)
            bound = vllm_server.binding_lines(log)
    except (RuntimeError, ValueError) as error:
        print(f"{NAME}: vLLM's server failed: {error}", file=sys.stderr)
        result["peer_error"] = {vllm_peer.NAME: str(error)}
        return
    result["peers"] = {vllm_peer.NAME: theirs}
    result["vllm_setup"] = (
        f"{vllm_peer.NAME} {version}: its OpenAI server (python -m {vllm_server.MODULE}), {dtype}, "
        f"{binding.vllm_label(args.vllm_bind)}, KV {args.vllm_kv_memory / 2**20:.0f}MiB, prefix caching on"
    )
    result["peer_settings"] = {
        vllm_peer.NAME: {
            "version": version, "api": "OpenAI server", "dtype": dtype, "bind": args.vllm_bind,
            "environment": binding.vllm_env(args.vllm_bind), "binding_log": bound,
            "kv_cache_memory_bytes": args.vllm_kv_memory, "enable_prefix_caching": True,
        }
    }  # fmt: skip
    result["ratios"] = {
        vllm_peer.NAME: {
            level: {key: report.ratio(ours.get(key), theirs[level].get(key), key) for key, _, _ in ROWS}
            for level, ours in result["pagedserve"].items()
        }
    }


def rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """The race's table: a row per concurrency, a column per figure; each cell pagedserve's figure, then
    vLLM's and the ratio (pagedserve ÷ vLLM for rates, vLLM ÷ pagedserve for times: above 1 pagedserve is
    ahead) when it ran."""
    theirs = result.get("peers", {}).get(vllm_peer.NAME)
    header = ["concurrency", *(label for _, label, _ in ROWS)]
    if theirs:
        header[1:] = [f"{label}, pagedserve / vLLM" for label in header[1:]]
    table = []
    for level, ours in result["pagedserve"].items():
        cells = [level]
        for key, _, fmt in ROWS:
            cell = fmt.format(ours[key])
            if theirs:
                ratio = report.ratio(ours[key], theirs[level][key], key)
                cell += f" / {fmt.format(theirs[level][key])} ({'-' if ratio is None else f'{ratio:.2f}×'})"
            cells.append(cell)
        table.append(cells)
    return header, table


def cpu_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """CPU seconds (user + system) each server process spent in a run, a row per concurrency: pagedserve's
    services, then vLLM's server's processes when it ran."""
    engines = {"pagedserve": result["pagedserve"], **result.get("peers", {})}
    columns = [
        (engine, key)
        for engine, levels in engines.items()
        for key in next(iter(levels.values()))
        if key.startswith(CPU_PREFIX)
    ]
    header = ["concurrency", *(f"{engine} {key.removeprefix(CPU_PREFIX)} CPU (s)" for engine, key in columns)]
    body = [
        [level, *(f"{engines[engine][level][key]:.1f}" for engine, key in columns)]
        for level in result["pagedserve"]
    ]
    return header, body


def table(result: dict) -> str:
    """The race as the bench prints it."""
    lines = [
        f"{result['workload']}: {result['description']}",
        f"(measured {result['date']} on {result['machine']})",
    ]
    lines += [f"({result[key]})" for key in ("setup", "vllm_setup") if key in result]
    header, body = rows(result)
    cpu_header, cpu_body = cpu_rows(result)
    return "\n".join([*lines, *report.aligned([header, *body]), "", *report.aligned([cpu_header, *cpu_body])])
