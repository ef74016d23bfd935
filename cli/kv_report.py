"""`python -m cli.kv_report`: what each KV dtype costs in quality and gives in capacity, the KV dtypes
table of docs/configuration.md. Runs compute's paged path in this process (no services) with float32
weights, each KV dtype against float32 KV on the same prompts:

- blocks: how many blocks the cache makes of the same --kv-memory (cache_service.kv_pool's sizing);
- greedy agreement over the e2e parity prompts (tests/e2e/prompts.py: 8 prompts, 32 new tokens):
  tokens identical until the first divergence, and identical positions overall;
- the largest |logit error| over teacher-forced decode steps on a fixed text;
- with --speed, the decode step time at 1 and 16 sequences of ~256 tokens: the dtypes' steps interleaved,
  round after round, so that load drifting on a shared machine hits them alike; medians of the rounds.

Run it from a checkout (it reads the prompts' text from tests/e2e/prompts.py).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cache_service.kv_pool import spec_from_request
from cache_service.options import DEFAULT_KV_MEMORY
from common.paging import blocks_for
from common.shared_pool import dtype_from_name
from compute_service.attention.kv_codec import NO_SCALES
from compute_service.batch import ForwardBatch
from compute_service.kv_calibration import calibrate
from compute_service.model_loader import load
from compute_service.runner import Runner
from compute_service.validation import Limits
from protos import cache_pb2, compute_pb2

KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
# Teacher forcing: this many sequences of TEACHER_PROMPT tokens, then TEACHER_STEPS decodes of the text.
TEACHER_SEQS, TEACHER_PROMPT, TEACHER_STEPS = 4, 256, 64
BLOCK_SIZE = 16
# --speed: sequences per step, their prompt, decode steps per round, rounds.
SPEED_BATCHES, SPEED_PROMPT, SPEED_STEPS, SPEED_ROUNDS = (1, 16), 256, 6, 3


class PagedRun:
    """Sequences stepped together through a Runner on a private pool of one KV dtype."""

    def __init__(self, model, kv_dtype: str, scales, lengths: list[int]) -> None:
        config = model.config
        widths = [blocks_for(n, BLOCK_SIZE) for n in lengths]
        self.tables = [list(range(sum(widths[:i]), sum(widths[: i + 1]))) for i in range(len(widths))]
        shape = (config.num_hidden_layers, 2, sum(widths), BLOCK_SIZE, config.num_key_value_heads)
        self.runner = Runner(model, scales)
        self.runner.attach(torch.zeros(*shape, config.head_dim, dtype=dtype_from_name(kv_dtype)))
        self.limits = Limits(config.vocab_size, config.max_position_embeddings, sum(widths), BLOCK_SIZE)
        self.cached = [0] * len(lengths)

    def step(self, new: list[list[int]]) -> torch.Tensor:
        """Appends `new[i]` to sequence i; float32 logits [N, V] after each one's last new token."""
        width = max(blocks_for(c + len(t), BLOCK_SIZE) for c, t in zip(self.cached, new, strict=True))
        rows = [(table + [-1] * width)[:width] for table in self.tables]
        cu = [0]
        for tokens in new:
            cu.append(cu[-1] + len(tokens))
        request = compute_pb2.ForwardRequest(
            token_ids=[t for tokens in new for t in tokens],
            cu_seqlens_q=cu,
            num_computed=self.cached,
            block_tables=[b for row in rows for b in row],
            block_table_width=width,
            sample=[True] * len(new),
            sampling=[compute_pb2.RowSampling(temperature=0)] * len(new),
        )
        logits = self.runner.logits(ForwardBatch.from_request(request, self.limits))
        self.cached = [c + len(t) for c, t in zip(self.cached, new, strict=True)]
        return logits


def greedy(model, kv_dtype: str, scales, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    run = PagedRun(model, kv_dtype, scales, [len(p) + new_tokens for p in prompts])
    out = [[] for _ in prompts]
    tokens = run.step(prompts).argmax(-1).tolist()
    for _ in range(new_tokens):
        for seq, token in zip(out, tokens, strict=True):
            seq.append(token)
        tokens = run.step([[t] for t in tokens]).argmax(-1).tolist()
    return out


def teacher_logits(model, kv_dtype: str, scales, texts: list[list[int]]) -> torch.Tensor:
    """[steps, N, V] logits of decode steps fed the texts' own next tokens after a TEACHER_PROMPT prefill."""
    run = PagedRun(model, kv_dtype, scales, [len(t) for t in texts])
    run.step([t[:TEACHER_PROMPT] for t in texts])
    steps = range(TEACHER_PROMPT, TEACHER_PROMPT + TEACHER_STEPS)
    return torch.stack([run.step([[t[i]] for t in texts]) for i in steps])


def decode_ms(model, path, ids: list[int]) -> dict[str, dict[int, float]]:
    """Median ms of one decode step per KV dtype and batch size (see the module's --speed)."""
    runs = {}
    for kv_dtype in KV_DTYPES:
        scales = calibrate(model, path, dtype_from_name(kv_dtype))
        for n in SPEED_BATCHES:
            length = SPEED_PROMPT + SPEED_ROUNDS * SPEED_STEPS + 1
            run = PagedRun(model, kv_dtype, scales, [length] * n)
            prompts = [ids[i * 7 : i * 7 + SPEED_PROMPT] for i in range(n)]
            runs[kv_dtype, n] = run, run.step(prompts).argmax(-1).tolist(), []
    for _ in range(SPEED_ROUNDS):
        for run, tokens, times in runs.values():
            for _ in range(SPEED_STEPS):
                start = time.perf_counter()
                tokens[:] = run.step([[t] for t in tokens]).argmax(-1).tolist()
                times.append(time.perf_counter() - start)
    result: dict[str, dict[int, float]] = {}
    for (kv_dtype, n), (_, _, times) in runs.items():
        result.setdefault(kv_dtype, {})[n] = round(statistics.median(times) * 1e3, 1)
    return result


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[int, int, int]:
    """(tokens identical until each prompt's first divergence, identical positions, total), summed."""
    prefix = same = total = 0
    for a, b in zip(ours, reference, strict=True):
        differ = [k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        prefix += differ[0] if differ else len(b)
        same += len(b) - len(differ)
        total += len(b)
    return prefix, same, total


def blocks_in(model, kv_dtype: str, memory: int) -> int:
    config = model.config
    geometry = cache_pb2.PoolGeometry(
        num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim
    )
    scales_id = "calibrated" if kv_dtype.startswith("fp8") else ""
    request = cache_pb2.CreatePoolRequest(
        geometry=geometry, block_size=BLOCK_SIZE, kv_dtype=kv_dtype, kv_scales_id=scales_id
    )
    return spec_from_request(request, 0, memory).num_blocks


def report(model_name: str, memory: int, speed: bool) -> list[dict]:
    from transformers import AutoTokenizer

    from common.model_files import local_copy
    from tests.e2e.prompts import PARITY_LENGTHS, PARITY_NEW_TOKENS, long_text, prompt_ids

    path = local_copy(model_name).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model, _ = load(model_name, torch.float32)
    prompts = prompt_ids(tokenizer, PARITY_LENGTHS)
    ids = tokenizer.encode(long_text(), add_special_tokens=False)
    span = TEACHER_PROMPT + TEACHER_STEPS
    texts = [ids[i * span : (i + 1) * span] for i in range(TEACHER_SEQS)]
    reference = greedy(model, "float32", NO_SCALES, prompts, PARITY_NEW_TOKENS)
    reference_logits = teacher_logits(model, "float32", NO_SCALES, texts)
    step_ms = decode_ms(model, path, ids) if speed else {}
    rows = []
    for kv_dtype in KV_DTYPES:
        scales = calibrate(model, path, dtype_from_name(kv_dtype))
        tokens = greedy(model, kv_dtype, scales, prompts, PARITY_NEW_TOKENS)
        error = (teacher_logits(model, kv_dtype, scales, texts) - reference_logits).abs()
        prefix, same, total = agreement(tokens, reference)
        rows.append(
            dict(
                kv_dtype=kv_dtype,
                blocks=blocks_in(model, kv_dtype, memory),
                prefix_agreement=prefix,
                agreement=same,
                tokens=total,
                prompts=len(prompts),
                prompts_identical=sum(a == b for a, b in zip(tokens, reference, strict=True)),
                max_logit_error=error.max().item(),
                mean_logit_error=error.mean().item(),
                decode_step_ms=step_ms.get(kv_dtype, {}),
            )
        )
    return rows


def table(rows: list[dict], memory: int) -> str:
    lines = [
        f"| KV dtype | blocks in {memory // 2**20} MiB | tokens identical until divergence | identical "
        "overall | prompts identical | max abs logit error | mean abs logit error | decode step, 1 / 16 "
        "sequences |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        speed = " / ".join(f"{ms} ms" for ms in r["decode_step_ms"].values()) or "–"
        lines.append(
            f"| {r['kv_dtype']} | {r['blocks']} | {r['prefix_agreement']}/{r['tokens']} | "
            f"{r['agreement']}/{r['tokens']} | {r['prompts_identical']}/{r['prompts']} | "
            f"{r['max_logit_error']:.4f} | {r['mean_logit_error']:.4f} | {speed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cli.kv_report", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--kv-memory-mib", type=int, default=DEFAULT_KV_MEMORY // 2**20)
    parser.add_argument(
        "--speed", action="store_true", help="also time decode steps (minutes; needs a quiet host)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    memory = args.kv_memory_mib * 2**20
    rows = report(args.model, memory, args.speed)
    print(table(rows, memory))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
