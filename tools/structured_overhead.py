"""What constrained decoding costs a decode step, two ways.

Through the stack: B concurrent requests constrained by a JSON schema, then the same B unconstrained, on one
stack (cache, compute and gateway as in tools/step_overhead.py), both at --decode-steps 1 (constrained rows
run one step per call), alternated --repeats times (medians kept: a shared machine's load drifts). Prints,
per B, the mean decode step of each, the overhead, and the gateway's mask work per step (filling, and what
a Forward request waited for it).

In one process (--parts): per B, the work a constrained step adds, each part timed alone: filling B masks
(the gateway's background job), packing them into the request, and compute's unpacking and masked sampling
against the greedy fast path an unconstrained greedy batch takes.

    PYTHONPATH=$PWD .venv/bin/python tools/structured_overhead.py --batches 1 8 32
    PYTHONPATH=$PWD .venv/bin/python tools/structured_overhead.py --parts --batches 1 8 32
"""

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from cli.scrape import scrape
from sdk.client import Client
from tests.helpers import free_port, socket_dir, stop
from tests.kv_stack import Stack
from tools.step_overhead import decode_totals
from tools.structured_samples import WIDE

MESSAGES = [{"role": "user", "content": "Fill in a record of forty fields as JSON."}]


def run_batch(target: str, batch: int, tokens: int, constrained: bool) -> None:
    """`batch` concurrent greedy chats of `tokens` tokens each (the schema has far more: none ends early)."""
    kwargs = {"json_schema": WIDE} if constrained else {"ignore_eos": True}

    def one() -> None:
        with Client(target, timeout=900) as client:
            done = client.generate(messages=MESSAGES, max_tokens=tokens, temperature=0.0, **kwargs)
            assert len(done.token_ids) == tokens, done.finish_reason

    threads = [threading.Thread(target=one) for _ in range(batch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def mask_totals(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {
        name: samples.get((f"pagedserve_grammar_{name}_seconds_sum", ()), 0.0)
        for name in ("mask", "mask_wait")
    }


def measure(url: str, target: str, batch: int, tokens: int, constrained: bool) -> dict[str, float]:
    before, masks = decode_totals(url), mask_totals(url)
    run_batch(target, batch, tokens, constrained)
    after, masks_after = decode_totals(url), mask_totals(url)
    steps = after["steps"] - before["steps"]
    return {
        "steps": steps,
        "step_ms": (after["wall"] - before["wall"]) / steps * 1e3,
        "sample_ms": (after["compute_sample"] - before["compute_sample"]) / steps * 1e3,
        **{f"{name}_ms": (masks_after[name] - masks[name]) / steps * 1e3 for name in masks},
    }


def stack_table(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch, socket_dir() as sockets:
        stack = Stack(Path(args.model), sockets, Path(scratch))
        metrics_port = free_port()
        try:
            stack.start_cache("--kv-blocks", "2048")
            stack.start_rest(free_port(), "--metrics-port", str(metrics_port), "--decode-steps", "1")
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            run_batch(stack.gateway_target, 2, 4, constrained=True)  # warm-up: the schema compiles
            print(
                "| batch | plain step ms | constrained step ms | overhead | mask fill ms | wait ms | "
                "compute sampling ms, plain / constrained |"
            )
            print("|---|---|---|---|---|---|---|")
            for batch in args.batches:
                runs = {False: [], True: []}
                for _ in range(args.repeats):
                    for constrained in (False, True):
                        runs[constrained].append(
                            measure(url, stack.gateway_target, batch, args.tokens, constrained)
                        )
                plain, constrained = (
                    {key: statistics.median(run[key] for run in runs[c]) for key in runs[c][0]}
                    for c in (False, True)
                )
                overhead = constrained["step_ms"] / plain["step_ms"] - 1
                print(
                    f"| {batch} | {plain['step_ms']:.2f} | {constrained['step_ms']:.2f} | {overhead:+.1%} | "
                    f"{constrained['mask_ms']:.3f} | {constrained['mask_wait_ms']:.3f} | "
                    f"{plain['sample_ms']:.2f} / {constrained['sample_ms']:.2f} |",
                    flush=True,
                )
        finally:
            for proc in reversed(stack.procs):
                stop(proc)


def _best_ms(work, repeats: int = 50) -> float:
    """The fastest of `repeats` timings of work(), in ms (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def parts_table(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from common.model_files import local_copy
    from compute_service.greedy import greedy
    from compute_service.sampling import SamplingBatch, sample
    from gateway.structured import matcher as matchers
    from gateway.structured.grammars import Grammars
    from gateway.structured.limits import ConstraintLimits
    from gateway.structured.spec import Spec
    from protos import compute_pb2

    tokenizer = AutoTokenizer.from_pretrained(local_copy(args.model).path)
    vocab, eos = len(tokenizer), [tokenizer.eos_token_id]
    # NOTE: one thread, as a decode step's sampling runs on a 2-core machine's compute: timings stay stable.
    torch.set_num_threads(1)
    grammars = Grammars(tokenizer, ConstraintLimits())
    grammars.prepare(vocab, eos)
    spec = Spec("json_schema", json.dumps(WIDE))
    start = time.perf_counter()
    grammars.matcher(spec, vocab, eos)
    print(f"compile (first, uncached): {(time.perf_counter() - start) * 1e3:.2f} ms")
    prefix = tokenizer.encode('{"field_0": "text", "field_1": 7, "field_2": tr', add_special_tokens=False)
    print("| batch | mask fill ms | pack ms | compute masked sample ms | greedy ms | added ms |")
    print("|---|---|---|---|---|---|")
    for batch in args.batches:
        rows = []
        for _ in range(batch):
            m = grammars.matcher(spec, vocab, eos)
            for token in prefix:
                m.mask()
                m.accept(token)
            rows.append(m)

        def fill(rows=rows) -> None:
            for m in rows:
                m._mask = None
            matchers.fill(rows)

        fill_ms, pack_ms = _best_ms(fill), _best_ms(lambda rows=rows: matchers.packed(rows))
        bitmask = matchers.packed(rows)
        logits = torch.randn(batch, vocab)
        params = [compute_pb2.RowSampling(temperature=0)] * batch

        def masked(bitmask=bitmask, logits=logits, params=params) -> None:
            b = SamplingBatch.from_params(
                params, constraint_rows=range(len(params)), constraint_bitmask=bitmask
            )
            sample(logits, b, torch.zeros(len(params), dtype=torch.int64))

        sample_ms, greedy_ms = _best_ms(masked), _best_ms(lambda logits=logits: greedy(logits, None))
        added = fill_ms + pack_ms + sample_ms - greedy_ms
        print(
            f"| {batch} | {fill_ms:.3f} | {pack_ms:.3f} | {sample_ms:.3f} | {greedy_ms:.3f} | {added:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs per batch (medians kept)")
    parser.add_argument("--parts", action="store_true", help="time the parts in one process instead")
    args = parser.parse_args()
    if args.parts:
        parts_table(args)
    else:
        stack_table(args)


if __name__ == "__main__":
    main()
