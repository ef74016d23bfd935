"""What a burst of long prompts does to running streams, with one mixed compute and with a prefill compute
beside the decode compute (`pagedserve up --prefill-computes 1`, docs/scaling.md), and what the hand-over
from one to the other costs a request.

Each layout is a whole `pagedserve up` (SmolLM2-135M, float32), started in turn: the mixed one with one
compute of --threads 2, the disaggregated one with two computes of --threads 1 each (the same two cores).
Per layout, --repeats rounds of: --streams greedy streams decoding; once each has its first tokens, a
burst of --burst prompts of --prompt-tokens distinct tokens (one token each); the streams' inter-token gaps
while the burst is prefilled (from its start to its last first token), and the burst's time to first token.
Then the hand-over: --handoffs requests alone (a --prompt-tokens prompt, 8 tokens): the gap from the first
token (sampled where the prompt ran) to the second (the first decode step) against the later gaps.

    PYTHONPATH=$PWD .venv/bin/python tools/disagg_burst.py --json docs/measurements/disagg-burst.json
"""

import argparse
import json
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

from cli.launch import Stack
from common.cpu import describe
from tests.helpers import ROOT

FLAGS = ("--dtype", "float32", "--kv-blocks", "2048", "--max-seqs", "32")
LAYOUTS = {
    "mixed": ("--threads", "2"),
    "disaggregated": ("--prefill-computes", "1", "--threads", "1"),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]


def burst_round(stack: Stack, args: argparse.Namespace, rng: random.Random) -> dict:
    """One round: the streams' token times around a burst, the burst's first-token times."""
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    started, stop = threading.Barrier(args.streams + 1), threading.Event()

    def stream(k: int) -> None:
        with stack.client() as client:
            chunks = client.stream(
                token_ids=prompt(32, rng), max_tokens=4000, temperature=0.0, ignore_eos=True
            )
            for chunk in chunks:
                arrivals[k].extend([time.monotonic()] * len(chunk.token_ids))
                if len(arrivals[k]) == 4:
                    started.wait()
                if stop.is_set():
                    chunks.close()
                    return

    def first_token(ids: list[int]) -> float:
        sent = time.monotonic()
        with stack.client() as client:
            client.generate(token_ids=ids, max_tokens=1, temperature=0.0)
        return time.monotonic() - sent

    with ThreadPoolExecutor(args.streams + args.burst) as pool:
        streams = [pool.submit(stream, k) for k in range(args.streams)]
        started.wait()
        begin = time.monotonic()
        ttft = list(pool.map(first_token, [prompt(args.prompt_tokens, rng) for _ in range(args.burst)]))
        end = time.monotonic()
        time.sleep(1.0)
        stop.set()
        for done in streams:
            done.result()
    gaps = [
        (b - a) * 1e3
        for times in arrivals
        for a, b in zip(times, times[1:], strict=False)
        if begin <= b <= end
    ]
    return {"gaps_ms": gaps, "ttft_s": ttft, "burst_s": end - begin}


def handoff(stack: Stack, args: argparse.Namespace, rng: random.Random) -> dict:
    """Requests alone: time to first token, the first-to-second token gap, the median later gap (ms)."""
    first, second, later = [], [], []
    for _ in range(args.handoffs):
        sent, times = time.monotonic(), []
        with stack.client() as client:
            ids = prompt(args.prompt_tokens, rng)
            for chunk in client.stream(token_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True):
                times.extend([time.monotonic()] * len(chunk.token_ids))
        first.append((times[0] - sent) * 1e3)
        second.append((times[1] - times[0]) * 1e3)
        later.append(statistics.median(b - a for a, b in zip(times[1:], times[2:], strict=False)) * 1e3)
    return {
        "ttft_ms": statistics.median(first),
        "first_gap_ms": statistics.median(second),
        "later_gap_ms": statistics.median(later),
    }


def measure(layout: str, args: argparse.Namespace, log_dir: Path) -> dict:
    stack = Stack.start(*FLAGS, *LAYOUTS[layout], "--model", args.model, log_dir=log_dir, cwd=ROOT)
    rng = random.Random(7)
    try:
        burst_round(stack, argparse.Namespace(**{**vars(args), "burst": 1, "prompt_tokens": 64}), rng)  # warm
        rounds = [burst_round(stack, args, rng) for _ in range(args.repeats)]
        gaps = [gap for r in rounds for gap in r["gaps_ms"]]
        ttft = [t for r in rounds for t in r["ttft_s"]]
        return {
            "flags": [*FLAGS, *LAYOUTS[layout]],
            "gaps_during_burst": len(gaps),
            "gap_p50_ms": round(percentile(gaps, 0.5), 1),
            "gap_p99_ms": round(percentile(gaps, 0.99), 1),
            "gap_max_ms": round(max(gaps), 1),
            "burst_ttft_p50_s": round(percentile(ttft, 0.5), 2),
            "burst_ttft_max_s": round(max(ttft), 2),
            "burst_s": [round(r["burst_s"], 2) for r in rounds],
            "handoff": {key: round(value, 1) for key, value in handoff(stack, args, rng).items()},
        }
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, default=4, help="greedy streams decoding through the burst")
    parser.add_argument("--burst", type=int, default=4, help="prompts of the burst, sent at once")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each burst prompt")
    parser.add_argument("--repeats", type=int, default=2, help="bursts per layout")
    parser.add_argument("--handoffs", type=int, default=5, help="requests alone, for the hand-over")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="the stacks' logs")
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = {layout: measure(layout, args, args.log_dir) for layout in args.layouts}
    report = {
        "date": date.today().isoformat(),
        "machine": describe(),
        "load_average_before_after": [list(load_before), list(os.getloadavg())],
        "model": args.model,
        "streams": args.streams,
        "burst": args.burst,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "layouts": results,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
