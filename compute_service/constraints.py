"""Constrained decoding's share of compute: the allowed-token bitmasks the gateway's grammar matchers packed
into a Forward (ForwardRequest.constraint_rows / constraint_bitmask) unpacked, checked, and applied to the
logits. Compute holds no matcher: every step's masks arrive with it."""

import numpy as np
import torch

from common.errors import InvalidArgument, RowsRefused


def words_per_row(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


def unpack(rows, bitmask: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [M] int64, blocked [M, 32 * words] bool: the tokens a row may not sample) of a request's masks,
    unchecked but for a layout that splits into whole rows of whole words."""
    rows = torch.tensor(list(rows), dtype=torch.int64)
    if not len(rows):
        if bitmask:
            raise InvalidArgument("constraint_bitmask is set without constraint_rows: name the rows it masks")
        return rows, torch.zeros((0, 0), dtype=torch.bool)
    if len(bitmask) % (4 * len(rows)):
        raise InvalidArgument(
            f"constraint_bitmask has {len(bitmask)} bytes: it needs whole int32 words for each of the "
            f"{len(rows)} constraint_rows"
        )
    # NOTE: inverted while packed (a byte per 8 tokens), so that no pass over [M, V] inverts it.
    packed = ~np.frombuffer(bitmask, dtype=np.uint8).reshape(len(rows), -1)
    blocked = np.unpackbits(packed, axis=1, bitorder="little").view(np.bool_)
    return rows, torch.from_numpy(blocked)


def check(rows: torch.Tensor, blocked: torch.Tensor, num_rows: int, vocab_size: int, sequences) -> None:
    """InvalidArgument unless the rows are distinct sampling rows in ascending order and each mask is one
    ceil(vocab / 32)-word row allowing at least one token of the vocabulary (RowsRefused names those)."""
    if not len(rows):
        return
    if (rows < 0).any() or (rows >= num_rows).any() or (rows.diff() <= 0).any():
        raise InvalidArgument(
            f"constraint_rows must be ascending, distinct indices of the {num_rows} sampling rows; "
            f"got {rows.tolist()[:20]}"
        )
    words = blocked.shape[1] // 32
    if words != words_per_row(vocab_size):
        raise InvalidArgument(
            f"constraint_bitmask rows have {words} words; a vocabulary of {vocab_size} tokens needs "
            f"{words_per_row(vocab_size)}"
        )
    empty = blocked[:, :vocab_size].all(dim=1)
    if empty.any():
        raise RowsRefused(
            f"the constraint mask of sampling row {int(rows[empty][0])} allows no token of the vocabulary",
            sequences[rows[empty]].tolist(),
        )


def apply_(logits: torch.Tensor, rows: torch.Tensor, blocked: torch.Tensor) -> None:
    """In place: the logits of tokens a row's mask leaves out become -inf."""
    blocked = blocked[:, : logits.shape[1]]
    if len(rows) == len(logits):  # every row constrained: no gather and scatter
        logits.masked_fill_(blocked, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill_(blocked, float("-inf"))
