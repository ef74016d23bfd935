"""Step time of running decodes plus one prompt chunk (issue 14), in one process through compute's runner:
how --prefill-tokens-with-decodes trades the decodes' stall for prompt throughput.

Each step packs 16 sequences decoding one token after 256 cached ones, plus one fresh prompt chunk of N
tokens, N in --chunks; the sizes alternate step by step (a shared host's noise hits all alike), timed in CPU
time of this thread with one torch thread. Prints the median step per N, its ratio to the decodes alone
and the step's tokens per second.

    PYTHONPATH=$PWD .venv/bin/python tools/mixed_step.py --chunks 0 128 256 512 1024 2048
"""

import argparse
import statistics
import time

import torch

from common.paging import blocks_for
from compute_service.model_loader import load
from tests.forward import forward_request
from tests.step_bench import BLOCK_SIZE, CONTEXT, make_runner, timed_step

DECODES = 16


def mixed_request(vocab_size: int, chunk: int):
    """DECODES decoding sequences on disjoint blocks, then (if chunk) one fresh prompt of chunk tokens."""
    per_seq = blocks_for(CONTEXT + 1, BLOCK_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(DECODES)]
    new = [[(7 * i + 11) % vocab_size] for i in range(DECODES)]
    cached = [CONTEXT] * DECODES
    if chunk:
        first = DECODES * per_seq
        tables.append(list(range(first, first + blocks_for(chunk, BLOCK_SIZE))))
        new.append([(13 * i + 5) % vocab_size for i in range(chunk)])
        cached.append(0)
    return forward_request(new, cached, tables, block_size=BLOCK_SIZE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 128, 256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, spec = load(args.model, torch.float32, fused=True)
    num_blocks = DECODES * blocks_for(CONTEXT + 1, BLOCK_SIZE) + blocks_for(max(args.chunks), BLOCK_SIZE)
    runner, limits = make_runner(model, spec, num_blocks)
    requests = {chunk: mixed_request(model.config.vocab_size, chunk) for chunk in args.chunks}
    times: dict[int, list[float]] = {chunk: [] for chunk in args.chunks}
    for _ in range(1 + args.repeats):
        for chunk, request in requests.items():
            times[chunk].append(timed_step(runner, limits, request, time.thread_time))
    medians = {chunk: statistics.median(t[1:]) for chunk, t in times.items()}
    alone = medians.get(0)
    for chunk, seconds in medians.items():
        ratio = f"  {seconds / alone:5.1f}x the decodes alone" if alone else ""
        tokens = (DECODES + chunk) / seconds
        step = f"{DECODES} decodes + {chunk:5d} prompt tokens: {seconds * 1e3:7.1f} ms"
        print(f"{step}{ratio}  {tokens:5.0f} tokens/s")


if __name__ == "__main__":
    main()
