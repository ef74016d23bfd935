"""Block-sparse decode (--sparse-attention) against dense attention on a long fixed text
(docs/sparse-attention.md): perplexity, next-token and free-running greedy agreement, and decode speed, at
each --contexts length.

The text is the Python language reference's topics as the interpreter ships them (pydoc_data.topics, every
topic in key order), tokenized by the model's tokenizer: no download. At a context of n tokens the first
n - S are prefilled densely once (S: --scored, 512); then each mode, on blocks of its own after that shared
prefix, decodes the remaining tokens one step each, fed the text's own tokens (teacher-forced: the perplexity
of the last S - 1 tokens of the n, each predicted by a decode step over all tokens before it, and how often
its argmax is dense attention's), and generates G tokens greedily after the prefix (G: --generated, 64; how
many of them match dense's, and how many before the first that does not). Decode speed: the mean step time
of the teacher-forced steps and the attention's share, every mode on the native decode stack (the plan's
choice for all-decode steps, dense and block-sparse alike), and the first sparse mode once more on the
Python layers beside it. Compute's own forward, in this process, block size 16, float32.

    PYTHONPATH=$PWD .venv/bin/python tools/sparse_attention.py [--contexts 2048 8192] \
        [--modes sink=1,recent=4,topk=8 sink=1,recent=4,topk=32] [--scored 512] [--generated 64] [--json OUT]
"""

import argparse
import contextlib
import json
import math
import pydoc_data.topics
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
from transformers import AutoTokenizer

from common import cpu
from common.model_files import DEFAULT_MODEL
from common.sparse_settings import parse
from compute_service.batch import ForwardBatch
from compute_service.model_loader import load
from compute_service.runner import Runner, StepTimes
from compute_service.validation import Limits
from tests.forward import forward_request

BLOCK, CHUNK = 16, 1024


def text_tokens(path) -> list[int]:
    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    return AutoTokenizer.from_pretrained(path)(text)["input_ids"]


class Bench:
    """One pool, its blocks handed out in order; runners of the loaded model(s) over it."""

    def __init__(self, model, num_blocks: int, scored: int, generated: int) -> None:
        self.model, self.next_block = model, 0
        self.scored, self.generated = scored, generated
        config = model.config
        kv_heads = config.num_key_value_heads
        self.pool = torch.zeros(config.num_hidden_layers, 2, num_blocks, BLOCK, kv_heads, config.head_dim)
        self.limits = Limits(config.vocab_size, config.max_position_embeddings, num_blocks, BLOCK)

    def blocks(self, tokens: int) -> list[int]:
        count = -(-tokens // BLOCK)
        self.next_block += count
        return list(range(self.next_block - count, self.next_block))

    def runner(self, plan) -> Runner:
        runner = Runner(self.model, plan=plan)
        runner.attach(self.pool)
        return runner

    def step(self, runner: Runner, new: list[int], cached: int, table: list[int], times: StepTimes):
        request = forward_request([new], [cached], [table], block_size=BLOCK)
        return runner.logits(ForwardBatch.from_request(request, self.limits), times)[-1]


@contextlib.contextmanager
def python_layers(model) -> Iterator[None]:
    """All-decode steps on the Python layers instead of the native decode stack, while the block runs."""
    stack, model.model.native_decode = model.model.native_decode, None
    try:
        yield
    finally:
        model.model.native_decode = stack


def measure(bench: Bench, plan, tokens: list[int], n: int, modes: list[str]) -> dict:
    prefix = n - bench.scored
    shared = bench.blocks(prefix)
    dense = bench.runner(replace(plan, sparse_attention=None))
    start = time.perf_counter()
    for first in range(0, prefix, CHUNK):
        last = bench.step(dense, tokens[first : min(first + CHUNK, prefix)], first, shared, StepTimes())
    prefill_s = time.perf_counter() - start
    runs = {"dense": teacher_forced(bench, dense, tokens, n, shared, last)}
    runs["dense"]["greedy"] = greedy(bench, dense, n, shared, last)
    for mode in modes:
        runner = bench.runner(replace(plan, sparse_attention=parse(mode)))
        runs[mode] = teacher_forced(bench, runner, tokens, n, shared, last)
        runs[mode]["greedy"] = greedy(bench, runner, n, shared, last)
    with python_layers(bench.model):
        runner = bench.runner(replace(plan, sparse_attention=parse(modes[0])))
        runs[f"{modes[0]}, Python layers"] = teacher_forced(
            bench, runner, tokens, n, shared, last, steps=bench.generated
        )
    dense_argmax, dense_greedy = runs["dense"]["argmax"], runs["dense"]["greedy"]
    for run in runs.values():
        argmax = run.pop("argmax")
        run["argmax_agreement"] = round(
            sum(a == b for a, b in zip(argmax, dense_argmax, strict=False)) / len(argmax), 4
        )
        ours = run.pop("greedy", None)
        if ours is not None:
            run["greedy_matches"] = sum(a == b for a, b in zip(ours, dense_greedy, strict=True))
            run["greedy_prefix"] = next(
                (i for i, (a, b) in enumerate(zip(ours, dense_greedy, strict=True)) if a != b), len(ours)
            )
    return {
        "context": n,
        "scored": bench.scored - 1,
        "generated": bench.generated,
        "prefill_s": round(prefill_s, 2),
        "runs": runs,
    }


def teacher_forced(bench, runner, tokens, n, shared, last, steps: int = 0) -> dict:
    """Decode steps fed tokens prefix .. prefix + steps - 1, on blocks of their own after the shared
    prefix."""
    prefix = n - bench.scored
    table, steps = shared + bench.blocks(bench.scored), steps or bench.scored - 1
    times, nll, argmax, step_s = StepTimes(), 0.0, [], []
    logits = last
    for i in range(prefix, prefix + steps):
        logprobs = logits.log_softmax(-1)
        if i > prefix:
            nll -= float(logprobs[tokens[i]])
        argmax.append(int(logits.argmax()))
        start = time.perf_counter()
        logits = bench.step(runner, [tokens[i]], i, table, times)
        step_s.append(time.perf_counter() - start)
    nll -= float(logits.log_softmax(-1)[tokens[prefix + steps]])
    argmax.append(int(logits.argmax()))
    # the first steps rebuild the block summaries of the whole prefix: the steady state is after them
    steady = step_s[2:]
    return {
        "perplexity": round(math.exp(nll / steps), 3) if steps == bench.scored - 1 else None,
        "decode_ms": round(1e3 * sum(steady) / len(steady), 2),
        "attention_ms": round(1e3 * times.attention / steps, 2),
        "argmax": argmax[1:],
    }


def greedy(bench, runner, n, shared, last) -> list[int]:
    prefix, table = n - bench.scored, shared + bench.blocks(bench.generated + 1)
    ids, logits = [], last
    for i in range(bench.generated):
        ids.append(int(logits.argmax()))
        logits = bench.step(runner, [ids[-1]], prefix + i, table, StepTimes())
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--modes", nargs="+", default=["sink=1,recent=4,topk=8", "sink=1,recent=4,topk=32"])
    parser.add_argument("--scored", type=int, default=512, help="tokens after the prefix (a multiple of 16)")
    parser.add_argument("--generated", type=int, default=64, help="greedy tokens after the prefix")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model, spec = load(args.model, torch.float32, backend="cpu-native", sparse_attention=parse(args.modes[0]))
    tokens = text_tokens(model.name_or_path)
    longest = max(args.contexts)
    if longest > spec.max_model_len or longest > len(tokens):
        raise SystemExit(f"a context of {longest} is beyond the model ({spec.max_model_len}) or the text")
    per_context = -(-longest // BLOCK) + (3 + len(args.modes) * 2) * -(
        -(args.scored + args.generated) // BLOCK
    )
    results = []
    for n in args.contexts:
        bench = Bench(model, per_context, args.scored, args.generated)
        results.append(measure(bench, spec.plan, tokens, n, args.modes))
        print(json.dumps(results[-1], indent=1), flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu.describe()}, {torch.get_num_threads()} torch threads",
        "model": spec.name,
        "text_tokens": len(tokens),
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
