"""A planned restart, measured: `pagedserve up` with a RocksDB tier, one prompt of random token ids, SIGTERM,
`up` again on the same storage, the same prompt. Prints (and writes as JSON) each run's TTFT before and after
the restart, cached_tokens and whether the greedy tokens agree; docs/reliability.md quotes it.

    python scripts/warm_restart.py --tokens 2500 --runs 3 --json /tmp/warm-restart.json [-- up flags...]
"""

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from cli.launch import Stack

ROOT = Path(__file__).resolve().parent.parent


def generate(stack: Stack, prompt: list[int]) -> dict:
    with stack.client(timeout=600) as client:
        reply = client.generate(token_ids=prompt, max_tokens=1, temperature=0.0, ignore_eos=True)
    return {
        "ttft_s": reply.timings.time_to_first_token_s,
        "cached_tokens": reply.usage.cached_tokens,
        "token_ids": list(reply.token_ids),
    }


def flushed(log: Path) -> dict | None:
    """The cache's kv_tier_flushed event in a stack's JSON log (None: the stop wrote nothing that way)."""
    for line in log.read_text(errors="replace").splitlines():
        if '"kv_tier_flushed"' in line:
            return json.loads(line[line.index("{") :])
    return None


def one_run(prompt: list[int], flags: list[str], storage: Path, logs: Path) -> dict:
    """Cold on an empty tier, SIGTERM, warm on what the stop wrote."""
    tier = ["--kv-tier", "rocksdb", "--kv-tier-path", str(storage), "--log-format", "json"]
    served, stop = [], None
    for _ in range(2):
        stack = Stack.start(*tier, *flags, log_dir=logs, cwd=ROOT, timeout=900)
        try:
            served.append(generate(stack, prompt))
        finally:
            code = stack.stop()
        if code != 0:
            raise SystemExit(f"pagedserve up exited with {code}")
        stop = stop or flushed(stack.proc.log_path)
    cold, warm = served
    return {
        "cold_ttft_s": cold["ttft_s"],
        "warm_ttft_s": warm["ttft_s"],
        "warm_cached_tokens": warm["cached_tokens"],
        "same_tokens": cold["token_ids"] == warm["token_ids"],
        "flush": {key: stop[key] for key in ("blocks", "bytes", "seconds", "stopped_by")} if stop else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2500, help="prompt length in tokens")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--json", type=Path, help="also write the runs and their medians here")
    parser.add_argument("flags", nargs="*", help="more `pagedserve up` flags (after --)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    runs = []
    for index in range(args.runs):
        prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]
        with tempfile.TemporaryDirectory(prefix="warm-restart-") as work:
            runs.append(one_run(prompt, args.flags, Path(work) / "tier", Path(work)))
        print(f"run {index + 1}: {json.dumps(runs[-1])}", flush=True)
    medians = {key: statistics.median(run[key] for run in runs) for key in ("cold_ttft_s", "warm_ttft_s")}
    medians["ratio"] = medians["cold_ttft_s"] / medians["warm_ttft_s"]
    print(f"median TTFT cold {medians['cold_ttft_s']:.2f} s, warm {medians['warm_ttft_s']:.3f} s, "
          f"{medians['ratio']:.1f}x lower")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"tokens": args.tokens, "runs": runs, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
