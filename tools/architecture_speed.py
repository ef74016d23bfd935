"""Each model directory through the whole stack against transformers' own forward on the same weights
(docs/models.md, Speed): the latency workload (one 256-token prompt, 128 new tokens) and the throughput one
(16 such prompts, 64 new each) of `pagedserve bench`, greedy, float32, the stack's default backend and
layer path; transformers' `generate` on one left-padded batch of the same prompts (its default attention),
in this process, at each of --peer-threads torch threads, the best kept (on a machine other processes
load, one thread can beat two by several times: OpenMP's barriers wait on descheduled threads).
transformers' continuous batching (generate_batch) is left out: it sizes its cache by the machine's free
memory.

    PYTHONPATH=$PWD .venv/bin/python tools/architecture_speed.py DIR [DIR ...] [--repeat 3] [--json OUT]
    PYTHONPATH=$PWD .venv/bin/python tools/architecture_speed.py --table OUT   # the docs' table of OUT
"""

import argparse
import datetime
import json
from pathlib import Path

import torch
from transformers import AutoConfig

from cli.bench import driver, peers
from cli.bench.workloads import build
from cli.launch import Stack
from common import cpu
from protos import compute_pb2

WORKLOADS = ("latency", "throughput")
FIGURES = ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "threads")


def measure(model: Path, repeat: int, peer_threads: list[int], names: list[str]) -> dict:
    vocab = AutoConfig.from_pretrained(model).vocab_size
    workloads = {name: build(name, vocab) for name in names}
    stack = Stack.start("--model", str(model), "--dtype", "float32", "--log-level", "warning")
    try:
        info = stack.compute().GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10)
        ours = {
            name: driver.median_of([driver.run(w, stack.target, stack.cache_target) for _ in range(repeat)])
            for name, w in workloads.items()
        }
    finally:
        stack.stop()
    reference = peers.load(str(model), "float32")
    theirs = {name: _best_peer(reference, w, repeat, peer_threads) for name, w in workloads.items()}
    plan = info.execution_plan
    return {
        "architecture": plan.architecture,
        **{stage.stage: stage.implementation for stage in plan.stages if stage.stage.startswith("layers")},
        "attention_backend": info.attention_backend,
        "transformers_attention": reference.config._attn_implementation,
        **{name: {"pagedserve": _pick(ours[name]), "transformers": _pick(theirs[name])} for name in names},
    }


def _best_peer(model, workload, repeat: int, thread_counts: list[int]) -> dict:
    """transformers' median figures at the thread count that gave the most tokens/s."""
    runs = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        figures = driver.median_of([peers.generate_padded(model, workload) for _ in range(repeat)])
        runs.append({**figures, "threads": threads})
    return max(runs, key=lambda figures: figures["tokens_per_s"])


def _pick(figures: dict) -> dict:
    return {key: round(figures[key], 2) for key in FIGURES if figures.get(key) is not None}


def table(recorded: dict) -> str:
    """The markdown table of a --json file: one row per architecture and workload."""
    rows = [
        f"{recorded['date']}, {recorded['machine']}, repeat {recorded['repeat']}.",
        "",
        "| architecture | workload | layers (prompt / decode) | tokens/s pagedserve / transformers | ratio "
        "| TTFT p50 ms | inter-token p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, result in recorded["results"].items():
        for workload in WORKLOADS:
            if workload not in result:
                continue
            ours, theirs = result[workload]["pagedserve"], result[workload]["transformers"]
            rows.append(
                f"| {name} | {workload} | {result['layers']} / {result['layers.decode']} "
                f"| {ours['tokens_per_s']:.1f} / {theirs['tokens_per_s']:.1f} ({theirs['threads']} threads) "
                f"| {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x "
                f"| {ours['ttft_p50_ms']:.0f} / {theirs['ttft_p50_ms']:.0f} "
                f"| {ours['itl_p50_ms']:.1f} / {theirs['itl_p50_ms']:.1f} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--table", type=Path, help="print the markdown table of a --json file and exit")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--peer-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    results = {}
    for model in args.models:
        results[model.name] = result = measure(model, args.repeat, args.peer_threads, args.workloads)
        for name in args.workloads:
            ours, theirs = result[name]["pagedserve"], result[name]["transformers"]
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
            print(f"{model.name} {name}: {ours} vs transformers {theirs}: {ratio:.2f}x tokens/s", flush=True)
    if args.json:
        recorded = {
            "date": datetime.date.today().isoformat(),
            "machine": cpu.describe(),
            "repeat": args.repeat,
            "results": results,
        }
        args.json.write_text(json.dumps(recorded, indent=1))


if __name__ == "__main__":
    main()
