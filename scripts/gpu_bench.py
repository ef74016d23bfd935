"""A short in-process bench of the compute step on a GPU: a random-weight model of SmolLM2-135M's shape
(no download), paged on a CUDA pool, through the cuda attention backend. Decode steps at several batch sizes
over ~256-token contexts, and one prefill step; medians over repeats, CUDA-synchronized. Prints one JSON
object (also written to the path given as the only argument).

    python scripts/gpu_bench.py $OUT/bench.json
"""

import json
import os
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from compute_service.attention import cuda
from compute_service.batch import ForwardBatch
from compute_service.model_loader import register_attention
from compute_service.runner import Runner
from compute_service.validation import Limits
from tests.forward import forward_request
from tests.tiny_model import SMOLLM2_SHAPE

SMOLLM2_135M = dict(SMOLLM2_SHAPE, tie_word_embeddings=True)
CONTEXT, PREFILL = 256, 2048
# BENCH_DEVICE=cpu BENCH_REPEATS=1 checks the script itself where no GPU is.
DEVICE, REPEATS = os.environ.get("BENCH_DEVICE", "cuda"), int(os.environ.get("BENCH_REPEATS", "10"))


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(runner: Runner, batch: ForwardBatch) -> float:
    """Median milliseconds of the step over REPEATS, after one warm-up."""
    runner.forward(batch)
    times = []
    for _ in range(REPEATS):
        synchronize()
        start = time.perf_counter()
        runner.forward(batch)
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(block_size: int) -> dict:
    config = LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(
        config, attn_implementation=register_attention("cuda"), dtype=torch.bfloat16
    )
    model = model.eval().to(DEVICE)
    per_seq = -(-(max(CONTEXT + 1, PREFILL)) // block_size)
    seqs = 64 if DEVICE == "cuda" else 16
    num_blocks = per_seq * seqs
    shape = (config.num_hidden_layers, 2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    runner = Runner(model)
    runner.attach(torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE))
    limits = Limits(config.vocab_size, config.max_position_embeddings, num_blocks, block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    results = {"block_size": block_size, "flash_attn": cuda.flash_varlen() is not None}
    for n in (1, 16, 64)[: 3 if DEVICE == "cuda" else 2]:
        request = forward_request([[7]] * n, [CONTEXT] * n, tables[:n], block_size=block_size)
        results[f"decode_ms_{n}"] = round(timed(runner, ForwardBatch.from_request(request, limits)), 3)
    request = forward_request([[7] * PREFILL], [0], tables[:1], block_size=block_size)
    prefill_ms = timed(runner, ForwardBatch.from_request(request, limits))
    results["prefill_ms_2048"] = round(prefill_ms, 3)
    results["prefill_tokens_per_s"] = round(PREFILL / prefill_ms * 1e3)
    return results


if __name__ == "__main__":
    report = {
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "runs": [main(block_size) for block_size in (16, 256)],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            out.write(text + "\n")
