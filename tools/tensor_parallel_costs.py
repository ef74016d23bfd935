"""What tensor parallelism costs on this machine's cpus (docs/scaling.md): a random-weight Llama of a real
model's shape run whole (one process, all threads) and split over two gloo ranks (one thread each) by
compute_service.tensor_parallel, for a one-token decode step and a prompt chunk: the step's wall, the time its
all-reduces took (two a layer), the bytes they move; and the LM head replicated (rank 0 multiplies the whole
vocabulary, nothing moves) against split by vocabulary (each rank half, then an all-gather of the logits).
Prints JSON; the model runs transformers' layers with SDPA attention (no paged pool: the pool changes neither
the products nor the all-reduces).

    PYTHONPATH=$PWD .venv/bin/python tools/tensor_parallel_costs.py \
        > docs/measurements/tensor-parallel-cpu.json
"""

import argparse
import json
import os
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from compute_service import tensor_parallel

# Qwen2.5-0.5B's shape (14 query and 2 KV heads of 64, both split by 2), as a Llama.
SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
)


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def timed(fn, repeats: int) -> float:
    """The median wall of fn() in ms, after one warm-up."""
    fn()
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        walls.append((time.perf_counter() - start) * 1e3)
    return statistics.median(walls)


def steps(net: LlamaForCausalLM, tokens: int, repeats: int) -> dict:
    """A step of `tokens` new tokens (the hidden states, then the head on the last one): wall and the
    all-reduces' share (median over repeats)."""
    ids = torch.randint(0, SHAPE["vocab_size"], (1, tokens))
    reduce_ms = []

    def step():
        before = tensor_parallel.reduce_seconds(net)
        with torch.inference_mode():
            hidden = net.model(input_ids=ids).last_hidden_state[:, -1]
            net.lm_head(hidden)
        reduce_ms.append((tensor_parallel.reduce_seconds(net) - before) * 1e3)

    wall = timed(step, repeats)
    reduces = sum(isinstance(module, tensor_parallel.RowParallel) for module in net.modules())
    return {
        "tokens": tokens,
        "wall_ms": round(wall, 2),
        # NOTE: an all-reduce waits for the slower rank too: this is the ranks' skew plus the transfer.
        "all_reduce_ms": round(statistics.median(reduce_ms), 2),
        "all_reduces": reduces,
        "all_reduce_bytes": reduces * tokens * SHAPE["hidden_size"] * 4,
    }


def heads(net: LlamaForCausalLM, rank: int, size: int, repeats: int) -> dict:
    """The LM head on one token: whole on one rank, or this rank's part of the vocabulary, then an
    all-gather."""
    hidden = torch.randn(1, SHAPE["hidden_size"])
    weight = net.lm_head.weight.detach()
    part = weight.shape[0] // size
    mine = weight[rank * part : (rank + 1) * part].contiguous()
    parts = [torch.empty(1, part) for _ in range(size)]

    def split():
        dist.all_gather(parts, hidden @ mine.T)
        return torch.cat(parts, -1)

    with torch.inference_mode():
        return {
            "replicated_ms": round(timed(lambda: hidden @ weight.T, repeats), 3),
            "vocab_split_ms": round(timed(split, repeats), 3),
            "all_gather_bytes": SHAPE["vocab_size"] * 4,
        }


def rank_main(rank: int, size: int, port: int, repeats: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    net = model()
    tensor_parallel.shard(net, rank, size)
    result = {"decode": steps(net, 1, repeats), "prefill": steps(net, 128, max(3, repeats // 10))}
    result["lm_head"] = heads(net, rank, size, repeats)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    whole = model()
    single = {
        "decode": steps(whole, 1, args.repeats),
        "prefill": steps(whole, 128, max(3, args.repeats // 10)),
    }
    del whole
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, 2, port, args.repeats, queue)) for r in range(2)]
    for process in ranks:
        process.start()
    split = queue.get()
    for process in ranks:
        process.join()
    print(
        json.dumps(
            {
                "what": "tensor-parallel costs of a Qwen2.5-0.5B-shaped Llama, float32, gloo on the cpu",
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
                "date": time.strftime("%Y-%m-%d"),
                "torch": torch.__version__,
                "shape": SHAPE,
                "one_process": {"threads": os.cpu_count(), **single},
                "two_ranks": {"threads_per_rank": 1, **split},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
