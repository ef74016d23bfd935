"""A decode step through compute's runner, two model variants against each other, in one process:
transformers' layers against the fused ones (`--compare fused`), nn.Linear against the packed linears
(`--compare linear`, both fused), or the fused Python layers against the native decode stack on the same
loaded model (`--compare decode-stack`, the stack switched off and on between steps; `--weights` picks the
linears it multiplies), or prompt steps on torch's row-wise ops against the native ones (`--compare row-ops`
with `--prefill N`: decode steps take the native stack either way).

    PYTHONPATH=$PWD python -m tests.step_bench [--model smollm2] [--sizes 1 4 16 64] [--prefill 512]

Each variant runs the same packed request (every sequence decoding one token after CONTEXT cached ones)
from ForwardBatch.from_request to the sampled tokens, as the Forward RPC does; the variants alternate step
by step so that a shared machine's noise hits both alike. With one torch thread (the default) a step is
timed in CPU time of this thread, which other processes on a busy host do not inflate; with more, in wall
time. Prints the median step per batch size and the ratio; `--profile` adds torch.profiler's top ops of one
fused step per size.
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common.paging import blocks_for
from compute_service.batch import ForwardBatch
from compute_service.llama_layer import TORCH_ROW_OPS
from compute_service.model_loader import load
from compute_service.runner import Runner, StepTimes
from compute_service.validation import Limits
from tests.forward import forward_request

BLOCK_SIZE, CONTEXT = 16, 256
# per comparison: the baseline's and the new variant's loader options
VARIANTS = {
    "fused": {"transformers": {"fused": False}, "fused": {"fused": True}},
    "linear": {"nn.Linear": {"plain_linear": True}, "packed": {}},
}
DECODE_STACK = "decode-stack"
# prompt steps on torch's row-wise ops against the native ones (compute_service.llama_layer.RowOps); with
# --sizes 1 --prefill N
ROW_OPS = "row-ops"


def step_request(model, num_seqs: int):
    """num_seqs sequences of CONTEXT cached tokens, each decoding one token, on disjoint blocks."""
    per_seq = blocks_for(CONTEXT + 1, BLOCK_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
    new = [[(7 * i + 11) % model.config.vocab_size] for i in range(num_seqs)]
    return forward_request(new, [CONTEXT] * num_seqs, tables, block_size=BLOCK_SIZE)


def prefill_request(model, num_tokens: int):
    """One fresh prompt of num_tokens tokens."""
    tokens = [(13 * i + 5) % model.config.vocab_size for i in range(num_tokens)]
    return forward_request(
        [tokens], [0], [list(range(blocks_for(num_tokens, BLOCK_SIZE)))], block_size=BLOCK_SIZE
    )


def make_runner(model, spec, num_blocks: int) -> tuple[Runner, Limits]:
    runner = Runner(model, spec.kv_scales, spec.plan)
    shape = (spec.num_layers, 2, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    runner.attach(torch.randn(shape, dtype=spec.kv_dtype) * 0.5)
    return runner, Limits(spec.vocab_size, spec.max_model_len, num_blocks, BLOCK_SIZE)


def timed_step(runner: Runner, limits: Limits, request, clock=time.perf_counter) -> float:
    start = clock()
    batch = ForwardBatch.from_request(request, limits)
    runner.forward(batch, StepTimes())
    return clock() - start


def use_stack(runner: Runner, stack) -> None:
    """Runs the fused model's all-decode steps on `stack` (None: the Python layers); a model without the
    fused layers has none to set."""
    if hasattr(runner.model.model, "native_decode"):
        runner.model.model.native_decode = stack


def load_variants(args, num_blocks: int) -> tuple[dict, dict, dict]:
    """Each variant's runner and limits, the native stack it runs decodes on (None: Python layers) and the
    row-wise ops it sets (none: the loader's)."""
    if args.compare in (DECODE_STACK, ROW_OPS):
        # NOTE: one model and pool for both: only the forward of the step differs.
        model, spec = load(args.model, torch.float32, backend=args.backend, weights=args.weights)
        stack = getattr(model.model, "native_decode", None)
        assert stack is not None, f"the plan runs no native decode stack: {spec.plan.decode_layers.reason}"
        runner = make_runner(model, spec, num_blocks)
        if args.compare == ROW_OPS:
            names = ("torch ops", "native ops")
            ops = dict(zip(names, (TORCH_ROW_OPS, model.model.row_ops), strict=True))
            return dict.fromkeys(names, runner), dict.fromkeys(names, stack), ops
        names = ("python layers", "native stack")
        return dict.fromkeys(names, runner), dict(zip(names, (None, stack), strict=True)), {}
    variants, stacks = {}, {}
    for name, options in VARIANTS[args.compare].items():
        model, spec = load(args.model, torch.float32, backend=args.backend, weights=args.weights, **options)
        variants[name] = make_runner(model, spec, num_blocks)
        stacks[name] = getattr(model.model, "native_decode", None)
    return variants, stacks, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--prefill", type=int, default=0, help="also time one fresh prompt of this many tokens"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared host)")
    parser.add_argument("--compare", choices=[*sorted(VARIANTS), DECODE_STACK, ROW_OPS], default="fused")
    parser.add_argument("--backend", default="cpu-native", help="attention backend (default: float32's)")
    parser.add_argument("--weights", default="auto", help="the linears' weights (--weights of compute)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    num_blocks = max(
        max(args.sizes) * blocks_for(CONTEXT + 1, BLOCK_SIZE), blocks_for(args.prefill, BLOCK_SIZE)
    )
    variants, stacks, row_ops = load_variants(args, num_blocks)
    print(f"threads={torch.get_num_threads()} context={CONTEXT} clock={clock.__name__}")
    base, new = variants
    model = variants[new][0].model
    steps = [(f"{size:3d} seqs", step_request(model, size)) for size in args.sizes]
    if args.prefill:
        steps.append((f"prefill {args.prefill}", prefill_request(model, args.prefill)))
    for label, request in steps:
        times = {name: [] for name in variants}
        for _ in range(2 + args.repeats):
            for name, (runner, limits) in variants.items():
                use_stack(runner, stacks[name])
                if name in row_ops:
                    runner.model.model.row_ops = row_ops[name]
                times[name].append(timed_step(runner, limits, request, clock))
        medians = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
        ratio = medians[base] / medians[new]
        cells = "  ".join(f"{name} {ms:7.1f} ms" for name, ms in medians.items())
        print(f"{label}  {cells}  speed-up {ratio:.2f}x")
        if args.profile:
            runner, limits = variants[new]
            use_stack(runner, stacks[new])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                timed_step(runner, limits, request)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
