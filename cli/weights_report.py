"""`python -m cli.weights_report`: what each `--weights` mode costs in quality and gives in speed, the
tables of docs/configuration.md, Quantised weights. Runs compute's paged path in this process (no
services), each mode against float32 weights and activations:

- greedy agreement over the e2e parity prompts (tests/e2e/prompts.py: 8 prompts, 32 new tokens): tokens
  identical until each prompt's first divergence, and identical positions overall;
- perplexity on a fixed public-domain text (cli/data/perplexity_text.txt, the opening of Dickens' "A Tale
  of Two Cities"), one forward of plain transformers with the same quantised linears;
- with --speed, the decode step time (the full model through compute's Runner, sampling excluded) at
  SPEED_BATCHES sequences of SPEED_PROMPT tokens: the modes' steps interleaved round after round, so that
  load drifting on a shared machine hits them alike; medians of the rounds.

`--dense-head` adds rows with the output head kept dense, to weigh quantising it.
Run it from a checkout (it reads the prompts' text from tests/e2e/prompts.py).
"""

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from cli.kv_report import PagedRun, agreement, greedy
from common.model_files import local_copy
from common.shared_pool import dtype_from_name, dtype_name
from compute_service import planning
from compute_service.attention.kv_codec import NO_SCALES
from compute_service.linear import replace_linears
from compute_service.model_loader import load_planned, plan_for
from compute_service.plan import WEIGHT_ONLY, ExecutionPlan, LinearChoice
from compute_service.planning import Flags
from compute_service.quantized import QUANTIZED_MAX_ROWS, QUANTIZED_MODES

TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"
# (dtype, weights, output head quantised): float32 first, the reference.
MODES = [
    ("float32", "float32", True),
    ("bfloat16", "bfloat16", True),
    ("float32", "bfloat16", True),
    ("float32", "int8", True),
    ("float32", "int4", True),
    ("bfloat16", "int8", True),
    ("bfloat16", "int4", True),
]
SPEED_BATCHES, SPEED_PROMPT, SPEED_STEPS, SPEED_ROUNDS = (1, 4, 16, 64), 128, 4, 3


def tokenized_text(model_name: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(local_copy(model_name).path)
    return tokenizer.encode(TEXT.read_text(), add_special_tokens=False)


def build(model_name: str, dtype: str, weights: str, head: bool, kernel_max_rows: int):
    """The paged model in `dtype` with its linears held as `weights` (the output head too if `head`), on the
    cpu attention backend."""
    files, plan = plan_for(model_name, Flags(dtype_from_name(dtype), weights, attention_backend="cpu"))
    return load_planned(files, report_plan(plan, head, kernel_max_rows))[0]


def report_plan(plan: ExecutionPlan, head: bool, kernel_max_rows: int) -> ExecutionPlan:
    """`plan` with the output head dense unless `head` (the model's dtype, as a dense mode holds it), and
    torch's weight-only kernels up to `kernel_max_rows` rows."""
    if not head:
        flags = Flags(dtype_from_name(plan.dtype))
        dense = planning.dense_linears(flags, plan.dtype, plan.machine)
        plan = replace(plan, head_linear=replace(dense, reason="the report's dense head"))

    def rows(choice: LinearChoice) -> LinearChoice:
        return replace(choice, max_rows=kernel_max_rows) if choice.kernel == WEIGHT_ONLY else choice

    return replace(plan, decoder_linears=rows(plan.decoder_linears), head_linear=rows(plan.head_linear))


def perplexity(model_name: str, dtype: str, weights: str, head: bool) -> float:
    """exp(mean NLL) of the text's tokens, one forward of plain transformers with the same quantised linears.

    NOTE: a whole-text forward takes the int8 panels (float32 activations, as every step does), or on torch's
    kernels the dense GEMM on the dequantised weights, the values the kernel multiplies by; that kernel's
    bfloat16 activations add rounding the greedy columns see instead. One forward instead of a decode step
    per token keeps the report within minutes on a loaded host.
    """
    from transformers import AutoModelForCausalLM

    files, plan = plan_for(model_name, Flags(dtype_from_name(dtype), weights))
    plan = report_plan(plan, head, QUANTIZED_MAX_ROWS)
    model = AutoModelForCausalLM.from_pretrained(files.path, dtype=dtype_from_name(dtype)).eval()
    replace_linears(model, plan.decoder_linears, plan.head_linear)
    ids = torch.tensor([tokenized_text(model_name)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())


def decode_ms(models: dict, ids: list[int], batches: tuple[int, ...]) -> dict:
    """Median ms of one decode step per mode and batch size (see the module's --speed)."""
    runs = {}
    for key, model in models.items():
        for n in batches:
            run = PagedRun(
                model, dtype_name(model.dtype), NO_SCALES, [SPEED_PROMPT + SPEED_ROUNDS * SPEED_STEPS + 1] * n
            )
            prompts = [ids[i * 3 : i * 3 + SPEED_PROMPT] for i in range(n)]
            runs[key, n] = run, run.step(prompts).argmax(-1).tolist(), []
    for _ in range(SPEED_ROUNDS):
        for run, tokens, times in runs.values():
            for _ in range(SPEED_STEPS):
                start = time.perf_counter()
                tokens[:] = run.step([[t] for t in tokens]).argmax(-1).tolist()
                times.append(time.perf_counter() - start)
    result: dict = {}
    for (key, n), (_, _, times) in runs.items():
        result.setdefault(key, {})[n] = round(statistics.median(times) * 1e3, 1)
    return result


def report(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoTokenizer

    from tests.e2e.prompts import PARITY_LENGTHS, PARITY_NEW_TOKENS, long_text, prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(local_copy(args.model).path)
    prompts = prompt_ids(tokenizer, PARITY_LENGTHS)
    dense_head = [(d, w, False) for d, w, _ in MODES if d == "float32" and w in QUANTIZED_MODES]
    modes = [m for m in MODES + (dense_head if args.dense_head else []) if _chosen(m, args.modes)]
    models = {mode: build(args.model, *mode, args.kernel_max_rows) for mode in modes}
    reference = greedy(models[MODES[0]], "float32", NO_SCALES, prompts, PARITY_NEW_TOKENS)
    ids = tokenizer.encode(long_text(), add_special_tokens=False)
    step_ms = decode_ms(models, ids, tuple(args.batches)) if args.speed else {}
    rows = []
    for mode, model in models.items():
        tokens = greedy(model, dtype_name(model.dtype), NO_SCALES, prompts, PARITY_NEW_TOKENS)
        prefix, same, total = agreement(tokens, reference)
        rows.append(
            dict(
                dtype=mode[0],
                weights=mode[1],
                head=mode[2] or mode[1] == mode[0],
                prefix_agreement=prefix,
                agreement=same,
                tokens=total,
                prompts_identical=sum(a == b for a, b in zip(tokens, reference, strict=True)),
                prompts=len(prompts),
                perplexity=perplexity(args.model, *mode),
                decode_step_ms=step_ms.get(mode, {}),
            )
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _chosen(mode: tuple[str, str, bool], names: list[str] | None) -> bool:
    """Whether --modes (dtype:weights names) picks the mode; the float32 reference always runs."""
    return mode == MODES[0] or names is None or f"{mode[0]}:{mode[1]}" in names


def table(rows: list[dict], batches: tuple[int, ...]) -> str:
    batches = " / ".join(map(str, batches))
    lines = [
        "| --dtype | --weights | tokens identical until divergence | identical overall | prompts identical | "
        f"perplexity | decode step, {batches} sequences |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    base = rows[0]["perplexity"]
    for r in rows:
        speed = (
            " / ".join(f"{ms}" for ms in r["decode_step_ms"].values()) + " ms" if r["decode_step_ms"] else "–"
        )
        weights = r["weights"] + ("" if r["head"] else " (head dense)")
        lines.append(
            f"| {r['dtype']} | {weights} | {r['prefix_agreement']}/{r['tokens']} "
            f"| {r['agreement']}/{r['tokens']} | {r['prompts_identical']}/{r['prompts']} "
            f"| {r['perplexity']:.2f} ({100 * (r['perplexity'] / base - 1):+.1f} %) | {speed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cli.weights_report", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--speed", action="store_true", help="also time decode steps (needs a quiet host)")
    parser.add_argument(
        "--dense-head", action="store_true", help="also float32's quantised modes with a dense head"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--modes", nargs="+", help="only these dtype:weights modes (e.g. float32:int8)")
    parser.add_argument("--batches", type=int, nargs="+", default=SPEED_BATCHES, help="--speed's batch sizes")
    parser.add_argument(
        "--kernel-max-rows",
        type=int,
        default=QUANTIZED_MAX_ROWS,
        help="rows up to which the quantised kernel runs (to find the crossover with the dense GEMM)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = report(args)
    print(table(rows, tuple(args.batches)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
