"""Random paged K/V pools and shuffled block tables for the attention kernels' tests."""

import torch

from common import paging

NUM_BLOCKS = 256


def pool(block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, scale: float = 1.0):
    """K and V pools of finite random entries, stored as `dtype` (divided by `scale`, as fp8 stores)."""
    shape = (NUM_BLOCKS, block_size, kv_heads, head_dim)
    return tuple((torch.randn(shape) * 3 / scale).to(dtype) for _ in range(2))


def tables(context_lens: list[int], block_size: int, shared: int = 0) -> torch.Tensor:
    """Shuffled block tables; the first `shared` blocks are the same blocks in every row (a shared prefix)."""
    order = torch.randperm(NUM_BLOCKS).tolist()
    prefix, order = order[:shared], order[shared:]
    width = max(paging.blocks_for(n, block_size) for n in context_lens)
    rows = []
    for n in context_lens:
        own = paging.blocks_for(n, block_size) - shared
        rows.append(prefix + order[:own] + [-1] * (width - shared - own))
        order = order[own:]
    return torch.tensor(rows)
