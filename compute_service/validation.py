"""Checks a Forward request as sent, before anything is derived from it or touches the pool; every refusal
says which field is wrong and how."""

from dataclasses import dataclass

import torch

from common import paging
from common.errors import InvalidArgument
from common.sampling_limits import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY
from compute_service.sampling import SamplingBatch
from protos import compute_pb2


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int


@dataclass(slots=True)
class Sent:
    """The request's fields as int64/bool tensors, unchecked."""

    token_ids: torch.Tensor
    cu_seqlens_q: torch.Tensor
    num_computed: torch.Tensor
    block_tables: torch.Tensor  # flat, row-major [num_seqs * block_table_width]
    block_table_width: int
    sample: torch.Tensor
    sampling: SamplingBatch

    @classmethod
    def from_request(cls, request: compute_pb2.ForwardRequest) -> "Sent":
        def ints(field) -> torch.Tensor:
            return torch.tensor(field, dtype=torch.int64)

        return cls(
            token_ids=ints(request.token_ids),
            cu_seqlens_q=ints(request.cu_seqlens_q),
            num_computed=ints(request.num_computed),
            block_tables=ints(request.block_tables),
            block_table_width=request.block_table_width,
            sample=torch.tensor(request.sample, dtype=torch.bool),
            sampling=SamplingBatch.from_request(request),
        )

    def context_lens(self) -> torch.Tensor:
        """Per sequence: tokens in its KV after this step (computed + new); needs consistent counts."""
        return self.num_computed + self.cu_seqlens_q.diff()


def check_sent(sent: Sent, limits: Limits) -> None:
    """Raises InvalidArgument unless the counts fit together, the token ids are in the vocabulary and every
    context fits the model and has its blocks in its table, inside the pool."""
    _check_counts(sent)
    context_lens = sent.context_lens()
    _check_sequences(sent, context_lens, limits)
    _check_blocks(sent, context_lens, limits)
    _check_sampling(sent.sampling)
    _check_token_lists(sent.sampling, limits.vocab_size)


def check_writes(slot_mapping: torch.Tensor) -> None:
    """Raises InvalidArgument if two new tokens write one pool slot (sequences sharing a block they write)."""
    slots = slot_mapping.sort().values
    if (i := _first(slots[1:] == slots[:-1])) is not None:
        raise InvalidArgument(
            f"slot {int(slots[i])} is written by two new tokens in one step: sequences writing in this step "
            "must not share blocks in block_tables (copy on write first)"
        )


def _first(bad: torch.Tensor) -> int | None:
    """Index of the first true entry of a 1-D mask, or None."""
    hits = bad.nonzero()
    return int(hits[0, 0]) if len(hits) else None


def _check_counts(sent: Sent) -> None:
    num_tokens, cu = len(sent.token_ids), sent.cu_seqlens_q
    if num_tokens == 0:
        raise InvalidArgument("empty step: token_ids is empty; send at least one sequence with one new token")
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
    for field in ("num_computed", "sample"):
        if len(getattr(sent, field)) != num_seqs:
            raise InvalidArgument(
                f"{field} has {len(getattr(sent, field))} entries for {num_seqs} sequences in cu_seqlens_q"
            )
    width = sent.block_table_width
    if width < 1 or len(sent.block_tables) != num_seqs * width:
        raise InvalidArgument(
            f"block_tables has {len(sent.block_tables)} entries, expected num_seqs ({num_seqs}) * "
            f"block_table_width ({width}) with block_table_width >= 1"
        )
    if len(sent.sampling.seeds) != int(sent.sample.sum()):
        raise InvalidArgument(
            f"{len(sent.sampling.seeds)} sampling entries for {int(sent.sample.sum())} sequences with sample "
            "set: send one per sampling sequence, in order"
        )


def _check_sequences(sent: Sent, context_lens: torch.Tensor, limits: Limits) -> None:
    tokens, num_computed = sent.token_ids, sent.num_computed
    if (t := _first((tokens < 0) | (tokens >= limits.vocab_size))) is not None:
        raise InvalidArgument(
            f"token_ids[{t}] = {int(tokens[t])} is outside the vocabulary [0, {limits.vocab_size})"
        )
    if (seq := _first(num_computed < 0)) is not None:
        raise InvalidArgument(
            f"num_computed[{seq}] = {int(num_computed[seq])} is negative: it counts the sequence's tokens "
            "already in the KV cache before this step"
        )
    if (seq := _first(context_lens > limits.max_model_len)) is not None:
        raise InvalidArgument(
            f"sequence {seq} reaches {int(context_lens[seq])} tokens (num_computed[{seq}] = "
            f"{int(num_computed[seq])} plus its new tokens), beyond the model's maximum length "
            f"{limits.max_model_len}"
        )


def _check_blocks(sent: Sent, context_lens: torch.Tensor, limits: Limits) -> None:
    width = sent.block_table_width
    needed_blocks = paging.blocks_for(context_lens, limits.block_size)
    if (seq := _first(needed_blocks > width)) is not None:
        raise InvalidArgument(
            f"sequence {seq} needs {int(needed_blocks[seq])} blocks for {int(context_lens[seq])} tokens "
            f"(block size {limits.block_size}) but block_table_width is {width}"
        )
    tables = sent.block_tables.view(-1, width)
    outside = (tables < 0) | (tables >= limits.num_blocks)
    bad = (outside & (torch.arange(width) < needed_blocks[:, None])).flatten()
    if (entry := _first(bad)) is not None:
        seq, col = divmod(entry, width)
        raise InvalidArgument(
            f"block_tables[{seq}][{col}] = {int(tables[seq, col])} is outside the pool (block ids 0 .. "
            f"{limits.num_blocks - 1}), and sequence {seq} needs its first {int(needed_blocks[seq])} blocks "
            f"for {int(context_lens[seq])} tokens: use the tables the cache service returned for this pool"
        )


def _check_sampling(params: SamplingBatch) -> None:
    penalty = f"in [-{MAX_PENALTY}, {MAX_PENALTY}] (0 is off)"
    for name, bad, allowed in (
        ("temperature", ~(params.temperature >= 0) | params.temperature.isinf(), ">= 0 (0 is greedy)"),
        ("top_p", ~((params.top_p > 0) & (params.top_p <= 1)), "in (0, 1] (1 is off)"),
        ("top_k", params.top_k < 0, ">= 0 (0 is off)"),
        ("min_p", ~((params.min_p >= 0) & (params.min_p <= 1)), "in [0, 1] (0 is off)"),
        ("repetition_penalty", ~(params.repetition_penalty > 0) | params.repetition_penalty.isinf(),
         "> 0 and finite (1 is off)"),
        ("presence_penalty", ~(params.presence_penalty.abs() <= MAX_PENALTY), penalty),
        ("frequency_penalty", ~(params.frequency_penalty.abs() <= MAX_PENALTY), penalty),
        ("logprobs", (params.logprobs < 0) | (params.logprobs > MAX_LOGPROBS),
         f"in [0, {MAX_LOGPROBS}] (the number of alternatives)"),
        ("min_tokens", params.min_tokens < 0, ">= 0 (0 is off)"),
    ):  # fmt: skip
        if (i := _first(bad)) is not None:
            value = getattr(params, name)[i].item()
            raise InvalidArgument(f"sampling[{i}].{name} = {value} is invalid: it must be {allowed}")
    if (i := _first(~(params.bias_values.abs() <= MAX_LOGIT_BIAS))) is not None:
        raise InvalidArgument(
            f"sampling[{int(params.bias_rows[i])}].logit_bias[{int(params.bias_ids[i])}] = "
            f"{params.bias_values[i].item()} is invalid: biases lie in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"
        )


def _check_token_lists(params: SamplingBatch, vocab_size: int) -> None:
    """logit_bias and stop ids inside the vocabulary; the history and generated counts well formed."""
    num_rows = len(params.seeds)
    for name, rows, ids in (
        ("logit_bias", params.bias_rows, params.bias_ids),
        ("stop_token_ids", params.stop_rows, params.stop_ids),
    ):
        if (i := _first((ids < 0) | (ids >= vocab_size))) is not None:
            raise InvalidArgument(
                f"sampling[{int(rows[i])}].{name} has token id {int(ids[i])}, outside the vocabulary "
                f"[0, {vocab_size})"
            )
    if (params.min_tokens > 0).any() and len(params.output_lens) != num_rows:
        raise InvalidArgument(
            f"output_lens has {len(params.output_lens)} entries for {num_rows} sampling rows: min_tokens "
            "needs each row's generated token count"
        )
    if len(params.output_lens) not in (0, num_rows) or (params.output_lens < 0).any():
        raise InvalidArgument(f"output_lens must be empty or {num_rows} counts >= 0, one per sampling row")
    _check_history(params, vocab_size)


def _check_history(params: SamplingBatch, vocab_size: int) -> None:
    num_rows, cu, history = len(params.seeds), params.cu_history, params.history
    if not len(cu):
        if len(history) or len(params.history_prompt_lens):
            raise InvalidArgument("history_token_ids and history_prompt_lens need cu_history")
        return
    if len(cu) != num_rows + 1 or cu[0] != 0 or cu[-1] != len(history) or (cu.diff() < 0).any():
        raise InvalidArgument(
            f"cu_history must run from 0 to len(history_token_ids) ({len(history)}) without decreasing, "
            f"one offset per sampling row plus one ({num_rows + 1}); got {len(cu)} offsets"
        )
    prompt_lens = params.history_prompt_lens
    if len(prompt_lens) != num_rows or (prompt_lens < 0).any() or (prompt_lens > cu.diff()).any():
        raise InvalidArgument(
            "history_prompt_lens needs one count per sampling row, each between 0 and the length of the "
            "row's history"
        )
    if (t := _first((history < 0) | (history >= vocab_size))) is not None:
        raise InvalidArgument(
            f"history_token_ids[{t}] = {int(history[t])} is outside the vocabulary [0, {vocab_size})"
        )
