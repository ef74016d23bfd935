"""Orchestration overhead per decode step: how much of a step the gateway spends outside compute.

Starts cache, compute and gateway (unix sockets, as in tests/kv_stack.py), runs B concurrent greedy requests
per batch size and reads the gateway's step histograms (docs/operations.md, Metrics) before and after, so
that only the decode steps of that batch count. Prints, per batch size, the mean decode step and its split:

- compute: compute's own time (prepare + model, attention included, + sample, from its replies);
- overhead: the rest of the step (scheduling, the Reserve RPC, packing, the Forward RPC's transport,
  output handling), also as a share of the step.

    PYTHONPATH=$PWD .venv/bin/python tools/step_overhead.py --tiny --batches 1 4 16 64
    PYTHONPATH=$PWD .venv/bin/python tools/step_overhead.py --model smollm2 --tokens 16
"""

import argparse
import random
import tempfile
import threading
from pathlib import Path

from cli.scrape import scrape
from sdk.client import Client
from tests.helpers import free_port, socket_dir, stop
from tests.kv_stack import Stack

PHASES = ("schedule", "cache_rpc", "compute_rpc")
COMPUTE = ("compute_prepare", "compute_model", "compute_sample")  # attention is within model


def decode_totals(url: str) -> dict[str, float]:
    """Cumulative decode-step seconds per phase, the steps' wall seconds and their count."""
    samples = scrape(url)

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    totals = {"steps": value("pagedserve_step_duration_seconds_count", kind="decode")}
    totals["wall"] = value("pagedserve_step_duration_seconds_sum", kind="decode")
    for phase in (*PHASES, *COMPUTE):
        totals[phase] = value("pagedserve_step_phase_seconds_sum", kind="decode", phase=phase)
    return totals


def run_batch(target: str, batch: int, tokens: int, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(batch)]

    def one(prompt: list[int]) -> None:
        with Client(target, timeout=600) as client:
            client.generate(token_ids=prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True)

    threads = [threading.Thread(target=one, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def report(batch: int, before: dict[str, float], after: dict[str, float]) -> str:
    steps = after["steps"] - before["steps"]
    assert steps > 0, "no decode step ran"
    mean = {name: (after[name] - before[name]) / steps * 1e3 for name in after if name != "steps"}
    compute = sum(mean[name] for name in COMPUTE)
    overhead = mean["wall"] - compute
    gateway = mean["wall"] - mean["compute_rpc"]
    return (
        f"| {batch} | {int(steps)} | {mean['wall']:.2f} | {compute:.2f} | {overhead:.2f} "
        f"({overhead / mean['wall']:.1%}) | {gateway:.2f} ({gateway / mean['wall']:.1%}) | "
        f"{mean['schedule']:.2f} | {mean['cache_rpc']:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny random-weight model (tests/tiny_model.py)"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--decode-steps", default="8", help="the gateway's --decode-steps")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, socket_dir() as sockets:
        model, vocab = Path(args.model), 49152
        if args.tiny:
            from transformers import AutoTokenizer

            from common.model_files import local_copy
            from tests.tiny_model import save_tiny_llama

            model, vocab = save_tiny_llama(Path(scratch) / "tiny-llama"), 256
            AutoTokenizer.from_pretrained(local_copy("smollm2").path).save_pretrained(model)
        stack = Stack(model, sockets, Path(scratch))
        metrics_port = free_port()
        try:
            stack.start_cache("--kv-blocks", "2048")
            stack.start_rest(
                free_port(), "--metrics-port", str(metrics_port), "--decode-steps", args.decode_steps
            )
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            run_batch(stack.gateway_target, 1, 4, vocab, 0)  # warm-up
            print("| batch | decode steps | step ms | compute ms | overhead ms (share) | outside Forward ms "
                  "(share) | schedule ms | cache_rpc ms |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|")
            for batch in args.batches:
                before = decode_totals(url)
                run_batch(stack.gateway_target, batch, args.tokens, vocab, batch)
                print(report(batch, before, decode_totals(url)), flush=True)
        finally:
            for proc in reversed(stack.procs):
                stop(proc)


if __name__ == "__main__":
    main()
