"""Random-weight models of each served architecture at SmolLM2-135M's shape (30 layers, hidden 576, 9 query
and 3 KV heads of 64, MLP 1536, vocabulary 49,152), saved with SmolLM2's tokenizer, for `pagedserve bench
--model DIR` or tools/architecture_speed.py against transformers' generate on the same weights
(docs/models.md, Speed). Speed does not depend on the weights' values; each architecture keeps its own
features (windows, soft-caps, QK-norm, biases, experts: 8 of 192 wide, 2 per token).

    PYTHONPATH=$PWD .venv/bin/python tools/architecture_shapes.py OUT_DIR mistral gemma2 mixtral
    PYTHONPATH=$PWD .venv/bin/python tools/architecture_speed.py OUT_DIR/mistral OUT_DIR/gemma2
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.model_files import local_copy
from tests.architectures import CONFIGS
from tests.tiny_model import SMOLLM2_SHAPE

SHAPE = dict(SMOLLM2_SHAPE, initializer_range=0.02)
# What the real models use where the tiny test configs shrink it to below a prompt.
WINDOWS = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "gemma2": 4096, "gemma3_text": 512, "phi3": 2047,
           "mixtral": 4096, "qwen2_moe": 4096}  # fmt: skip
CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256}
EXPERTS = {"num_local_experts": 8, "num_experts": 8, "moe_intermediate_size": 192, "num_experts_per_tok": 2}


def config(name: str):
    cfg = CONFIGS[name]()
    for key, value in SHAPE.items():
        setattr(cfg, key, value)
    if name in WINDOWS:
        cfg.sliding_window = WINDOWS[name]
    for key, value in {**CAPS, **EXPERTS}.items():
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    if name == "mixtral":
        cfg.intermediate_size = EXPERTS["moe_intermediate_size"]  # Mixtral's experts take the MLP width
    if hasattr(cfg, "shared_expert_intermediate_size"):
        cfg.shared_expert_intermediate_size = 768
    if name == "gemma3_text":
        cfg.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)]
    elif hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = [cfg.layer_types[i % len(cfg.layer_types)] for i in range(30)]
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("names", nargs="+", choices=sorted(CONFIGS))
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(local_copy("smollm2").path)
    for name in args.names:
        torch.manual_seed(0)
        path = args.out / name
        AutoModelForCausalLM.from_config(config(name), dtype=torch.float32).save_pretrained(path)
        tokenizer.save_pretrained(path)
        print(path)


if __name__ == "__main__":
    main()
