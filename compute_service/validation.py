"""Checks a step before anything touches the pool; every refusal says which field is wrong and how."""

from dataclasses import dataclass

import torch

from common.errors import InvalidArgument
from compute_service.runner import Step
from compute_service.sampling_checks import check_sampling


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int


def check_step(step: Step, limits: Limits) -> None:
    """Raises InvalidArgument unless the step is well formed and writes only inside its sequences' blocks."""
    _check_lengths(step)
    _check_sequences(step, limits)
    _check_blocks(step, limits)
    check_sampling(step.sampling, limits.vocab_size)


def _first(bad: torch.Tensor) -> int | None:
    """Index of the first true entry of a 1-D mask, or None."""
    hits = bad.nonzero()
    return int(hits[0, 0]) if len(hits) else None


def _check_lengths(step: Step) -> None:
    num_tokens, cu = len(step.token_ids), step.cu_seqlens_q
    if num_tokens == 0:
        raise InvalidArgument("empty step: token_ids is empty; send at least one sequence with one new token")
    for field in ("positions", "slot_mapping"):
        if len(getattr(step, field)) != num_tokens:
            raise InvalidArgument(
                f"{field} has {len(getattr(step, field))} entries for {num_tokens} token_ids: one per token"
            )
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != num_tokens:
        raise InvalidArgument(
            f"cu_seqlens_q must run from 0 to the number of tokens ({num_tokens}), one offset per sequence "
            f"plus one; got {cu[:8].tolist()}{'...' if len(cu) > 8 else ''} ({len(cu)} offsets)"
        )
    if (seq := _first(cu.diff() < 1)) is not None:
        raise InvalidArgument(
            f"cu_seqlens_q is not increasing at sequence {seq} ({int(cu[seq])} -> {int(cu[seq + 1])}): "
            "every sequence needs at least one new token"
        )
    num_seqs = len(cu) - 1
    for field in ("context_lens", "sample"):
        if len(getattr(step, field)) != num_seqs:
            raise InvalidArgument(
                f"{field} has {len(getattr(step, field))} entries for {num_seqs} sequences in cu_seqlens_q"
            )
    width = step.block_table_width
    if width < 1 or len(step.block_tables) != num_seqs * width:
        raise InvalidArgument(
            f"block_tables has {len(step.block_tables)} entries, expected num_seqs ({num_seqs}) * "
            f"block_table_width ({width}) with block_table_width >= 1"
        )
    if len(step.sampling.seeds) != int(step.sample.sum()):
        raise InvalidArgument(
            f"{len(step.sampling.seeds)} sampling entries for {int(step.sample.sum())} sequences with sample "
            "set: send one per sampling sequence, in order"
        )


def _check_sequences(step: Step, limits: Limits) -> None:
    tokens, context_lens = step.token_ids, step.context_lens
    if (t := _first((tokens < 0) | (tokens >= limits.vocab_size))) is not None:
        raise InvalidArgument(
            f"token_ids[{t}] = {int(tokens[t])} is outside the vocabulary [0, {limits.vocab_size})"
        )
    q_lens = step.cu_seqlens_q.diff()
    if (seq := _first(context_lens < q_lens)) is not None:
        raise InvalidArgument(
            f"context_lens[{seq}] = {int(context_lens[seq])} is less than its {int(q_lens[seq])} new tokens: "
            "context_lens counts cached plus new tokens"
        )
    if (seq := _first(context_lens > limits.max_model_len)) is not None:
        raise InvalidArgument(
            f"context_lens[{seq}] = {int(context_lens[seq])} exceeds the model's maximum length "
            f"{limits.max_model_len}"
        )
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    offset = torch.arange(len(tokens)) - step.cu_seqlens_q[seq_of_token]
    expected = (context_lens - q_lens)[seq_of_token] + offset
    if (t := _first(step.positions != expected)) is not None:
        seq = int(seq_of_token[t])
        raise InvalidArgument(
            f"positions[{t}] = {int(step.positions[t])}, expected {int(expected[t])}: the new tokens of "
            f"sequence {seq} must sit at positions context_len - q_len .. context_len - 1 "
            f"({int(context_lens[seq] - q_lens[seq])} .. {int(context_lens[seq]) - 1})"
        )


def _check_blocks(step: Step, limits: Limits) -> None:
    bs, width = limits.block_size, step.block_table_width
    needed_blocks = (step.context_lens + bs - 1) // bs
    if (seq := _first(needed_blocks > width)) is not None:
        raise InvalidArgument(
            f"sequence {seq} needs {int(needed_blocks[seq])} blocks for {int(step.context_lens[seq])} tokens "
            f"(block size {bs}) but block_table_width is {width}"
        )
    tables = step.block_tables.view(-1, width)
    outside = (tables < 0) | (tables >= limits.num_blocks)
    bad = (outside & (torch.arange(width) < needed_blocks[:, None])).flatten()
    if (entry := _first(bad)) is not None:
        seq, col = divmod(entry, width)
        raise InvalidArgument(
            f"block_tables[{seq}][{col}] = {int(tables[seq, col])} is outside the pool (block ids 0 .. "
            f"{limits.num_blocks - 1}): use the tables the cache service returned for this pool"
        )
    seq_of_token = torch.repeat_interleave(torch.arange(len(tables)), step.cu_seqlens_q.diff())
    positions = step.positions
    expected = tables[seq_of_token, positions // bs] * bs + positions % bs
    if (t := _first(step.slot_mapping != expected)) is not None:
        raise InvalidArgument(
            f"slot_mapping[{t}] = {int(step.slot_mapping[t])}, expected {int(expected[t])} = block "
            f"{int(expected[t]) // bs} * block_size {bs} + {int(positions[t]) % bs} for position "
            f"{int(positions[t])} of sequence {int(seq_of_token[t])}"
        )
    slots = step.slot_mapping.sort().values
    if (i := _first(slots[1:] == slots[:-1])) is not None:
        raise InvalidArgument(
            f"slot {int(slots[i])} is written by two new tokens in one step: sequences writing in this step "
            "must not share blocks (copy on write first)"
        )
