"""Block arithmetic shared by the three services: how many blocks hold n tokens, and where a token lives.

The slot of token t of a sequence is `block_table[t // block_size] * block_size + t % block_size`, an index
into the pool's flattened [num_blocks * block_size] token axis.
"""

from typing import TYPE_CHECKING, TypeVar

# NOTE: torch for type hints only: the gateway and `pagedserve up`'s launcher import no torch.
if TYPE_CHECKING:
    import torch

N = TypeVar("N", int, "torch.Tensor")

# Decode steps one Compute.ForwardSteps call may run per row: compute refuses more, and the gateway's
# --decode-steps is capped at it (its tables then hold at most that many slots ahead).
MAX_DECODE_STEPS = 64
# Prompt-lookup drafts a row may feed per ForwardSteps step (StepsRequest.draft_tokens): compute refuses
# more, and the gateway's --draft-tokens is capped at it.
MAX_DRAFT_TOKENS = 16


def blocks_for(num_tokens: N, block_size: int) -> N:
    """Blocks needed to hold `num_tokens` tokens (ceiling division; ints or integer tensors)."""
    return -(-num_tokens // block_size)


def slots(block_tables: "torch.Tensor", positions: "torch.Tensor", block_size: int) -> "torch.Tensor":
    """Pool slots of the tokens at `positions` ([..., P], int64) of the sequences whose block tables are
    `block_tables` ([..., W]): [..., P]."""
    return block_tables.gather(-1, positions // block_size) * block_size + positions % block_size
