"""One rank's logits of models split by compute_service.tensor_parallel.shard, for the tests: the ranks
meet on gloo through a file, each loads every model whole (float32, transformers' eager attention), splits it
to its rank and saves the logits of one prompt, with the number of mixture-of-experts layers it split.

    python -m tests.sharded_forward RANK SIZE INIT_FILE OUT MODEL_DIR...   (writes OUT.RANK)
"""

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from compute_service import tensor_parallel

PROMPT = [5, 17, 99, 42, 7, 200, 31, 64, 3, 150, 8, 8, 2, 9, 77, 1, 250, 19, 11]


def logits(path: str, rank: int, size: int) -> tuple[torch.Tensor, int]:
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tensor_parallel.shard(model, rank, size)
    split = sum(isinstance(module, tensor_parallel.ReducedExperts) for module in model.modules())
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0], split


def main() -> None:
    rank, size, init, out, *models = sys.argv[1:]
    rank, size = int(rank), int(size)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    try:
        torch.save({path: logits(path, rank, size) for path in models}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
