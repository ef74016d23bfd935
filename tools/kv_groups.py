"""Blocks a sequence holds and sequences that fit in one --kv-memory, today's single table against KV groups
(cache_service/hybrid_blocks.py), from the cache service's own block managers and allocator: each sequence
is prefilled in chunks to the context, decodes one token, and sequences are added until a Reserve is refused.
Shapes are the published configs' (Mistral-7B-v0.1; Gemma-3-4B's text model), bf16 K/V (docs/models.md).

    PYTHONPATH=$PWD .venv/bin/python tools/kv_groups.py --kv-memory 16GiB --contexts 4096 16384
"""

import argparse

import torch
from transformers import Gemma3TextConfig, MistralConfig, PretrainedConfig

from cache_service.allocators import registry
from cache_service.hybrid_blocks import HybridBlocks
from cache_service.sequence import SeqRequest
from cache_service.units import parse_size
from common.errors import ResourceExhausted
from common.kv_groups import KVGroup, group_layers, group_size
from common.shared_pool import PoolSpec
from compute_service.architectures import sliding_windows

CONFIGS = {
    "mistral-7b": lambda: MistralConfig(),
    "gemma-3-4b": lambda: Gemma3TextConfig(
        num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024
    ),
}


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def fill(
    groups: tuple[KVGroup, ...], config: PretrainedConfig, args, context: int
) -> tuple[int, int, int, int]:
    """(bytes of one block id, block ids in the pool, block ids one sequence holds, sequences that reach the
    context)."""
    one = PoolSpec(group_size(groups), 1, args.block_size, config.num_key_value_heads, head_dim(config),
                   torch.bfloat16)  # fmt: skip
    num_blocks = args.kv_memory // one.block_bytes
    blocks = HybridBlocks(
        registry.create("freelist", num_blocks), groups, args.block_size, prefix_caching=False
    )
    held, fitted = [], 0
    try:
        while True:
            seq_id = f"s{fitted}"
            blocks.reserve([SeqRequest(seq_id, min(args.chunk, context))], ())
            for computed in range(args.chunk, context, args.chunk):
                end = min(context, computed + args.chunk)
                blocks.reserve((), [SeqRequest(seq_id, end, num_computed=computed)])
            blocks.reserve((), [SeqRequest(seq_id, context + 1, num_computed=context)])
            held.append(sum(blocks.held_blocks()))
            fitted += 1
    except ResourceExhausted:
        pass
    per_seq = held[0] if fitted else 0
    assert all(h == per_seq * (i + 1) for i, h in enumerate(held)), held
    return one.block_bytes, num_blocks, per_seq, fitted


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kv-memory", type=parse_size, default=parse_size("16GiB"))
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per Reserve")
    args = parser.parse_args()
    print(f"--kv-memory {args.kv_memory / 2**30:g} GiB, block size {args.block_size}, bf16, prefill chunks "
          f"of {args.chunk}, then one decode step")  # fmt: skip
    print("| model | context | layout | groups x layers | block ids | held per sequence (MiB) | sequences |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: |")
    for name, make in CONFIGS.items():
        config = make()
        windows = sliding_windows(config)
        layouts = {"single table": (KVGroup(tuple(range(len(windows)))),), "KV groups": group_layers(windows)}
        for context in args.contexts:
            for layout, groups in layouts.items():
                block_bytes, num_blocks, per_seq, fitted = fill(groups, config, args, context)
                mib = per_seq * block_bytes / 2**20
                shape, held = f"{len(groups)} x {group_size(groups)}", f"{per_seq} ({mib:.0f})"
                print(f"| {name} | {context} | {layout} | {shape} | {num_blocks} | {held} | {fitted} |")


if __name__ == "__main__":
    main()
