"""Decode step time with LoRA adapters in the step (docs/adapters.md), in one process through compute's
runner: 16 sequences decoding one token after 256 cached ones, their rows spread evenly over 0, 1, 4 or 8
distinct adapters of rank 16 on all seven targets (q/k/v/o, gate/up/down), beside the base step as planned
(the native decode stack where it runs) and the base step on the Python layers adapter steps take.

The adapters are random PEFT-format directories written here (adapter_config.json and
adapter_model.safetensors, read back by compute's own loader). The variants alternate step by step (a
shared host's noise hits all alike), timed in CPU time of this thread with one torch thread. Prints the
median step per variant and its ratio to the planned base step; --json writes them.

    PYTHONPATH=$PWD .venv/bin/python tools/lora_step.py --json docs/measurements/lora-step.json
"""

import argparse
import json
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.cpu import describe
from compute_service.lora.adapters import Adapters
from compute_service.lora.layers import ATTENTION
from compute_service.model_loader import load
from tests.step_bench import make_runner, step_request, timed_step

SEQS, RANK = 16, 16
LAYER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, adapters: Adapters, seed: int) -> Path:
    """A random rank-RANK adapter of every LAYER_TARGETS module of the model `adapters` wraps."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, target), site in adapters.sites.items():
        if target not in LAYER_TARGETS:
            continue
        out, inputs = site.shape
        block = "self_attn" if target in ATTENTION else "mlp"
        key = f"base_model.model.model.layers.{layer}.{block}.{target}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, inputs, generator=generator) * 0.01
        tensors[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=generator) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 32, "target_modules": list(LAYER_TARGETS)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the medians here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, spec = load(args.model, torch.float32, backend="cpu-native")
    adapters = Adapters.on(model, max_loras=max(args.adapters), max_rank=RANK)
    with tempfile.TemporaryDirectory() as root:
        for i in range(max(args.adapters)):
            adapters.load(f"a{i}", str(write_adapter(Path(root) / f"a{i}", adapters, seed=i)))
    request = step_request(model, SEQS)
    runner, limits = make_runner(model, spec, len(request.block_tables))
    runner.adapters = adapters
    stack = model.model.native_decode
    variants = {"base (as planned)": ([], stack), "base (python layers)": ([], None)}
    for count in args.adapters:
        ids = [1 + row * count // SEQS for row in range(SEQS)]
        variants[f"{count} adapters"] = (ids, stack)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats + 2):
        for name, (ids, native) in variants.items():
            model.model.native_decode = native
            del request.lora_ids[:]
            request.lora_ids.extend(ids)
            elapsed = timed_step(runner, limits, request, clock=time.thread_time)
            if repeat >= 2:
                times[name].append(elapsed)
    base = statistics.median(times["base (as planned)"])
    rows = {
        name: {"median_ms": statistics.median(t) * 1e3, "ratio": statistics.median(t) / base}
        for name, t in times.items()
    }
    for name, row in rows.items():
        print(f"{name:24} {row['median_ms']:8.2f} ms  {row['ratio']:.2f}x")
    if args.json:
        result = {
            "what": f"decode step of {SEQS} sequences (256 cached tokens each) with rank-{RANK} LoRA "
            "adapters on all seven targets, rows spread evenly over the adapters; median of CPU time of one "
            "torch thread",
            "model": spec.name,
            "plan": spec.plan.summary(),
            "machine": describe(),
            "date": date.today().isoformat(),
            "repeats": args.repeats,
            "steps": rows,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
