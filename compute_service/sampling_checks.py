"""Checks a step's sampling rows against the declared ranges (common.sampling_controls) and its token lists
and history against the vocabulary; every refusal names the row and field and says what is allowed. A
refusal caused by some rows only is a RowsRefused naming, as sequences of the step, every row that fails
that check; a malformed layout (counts that do not fit together) names none."""

import torch

from common.errors import InvalidArgument, RowsRefused
from common.sampling_controls import CONTROLS, Range
from compute_service import constraints
from compute_service.sampling import NUMBER_CONTROLS, SamplingBatch


def check_sampling(params: SamplingBatch, vocab_size: int, sequences: torch.Tensor | None = None) -> None:
    """Raises InvalidArgument unless every row's controls lie in their ranges and its lists are well formed
    (token ids inside the vocabulary, the history and generated counts one per row). `sequences` [S]: the
    step's sequence of each sampling row, what RowsRefused names (default: the sampling rows themselves)."""
    sequences = torch.arange(len(params.seeds)) if sequences is None else sequences
    assert len(sequences) == len(params.seeds), (len(sequences), len(params.seeds))
    _check_ranges(params, sequences)
    _check_token_lists(params, vocab_size, sequences)
    _check_history(params, vocab_size, sequences)
    constraints.check(params.constraint_rows, params.blocked, len(params.seeds), vocab_size, sequences)


def _first(bad: torch.Tensor) -> int | None:
    """Index of the first true entry of a 1-D mask, or None."""
    hits = bad.nonzero()
    return int(hits[0, 0]) if len(hits) else None


def _outside(values: torch.Tensor, bounds: Range) -> torch.Tensor:
    """Where values are NaN, infinite or past an end (one named after another control is the gateway's)."""
    bounds, bad = bounds.numeric(), ~values.isfinite()
    if bounds.low is not None:
        bad |= values <= bounds.low if bounds.low_open else values < bounds.low
    if bounds.high is not None:
        bad |= values >= bounds.high if bounds.high_open else values > bounds.high
    return bad


def _check_ranges(params: SamplingBatch, sequences: torch.Tensor) -> None:
    for name in (*NUMBER_CONTROLS, "logprobs"):
        control, values = CONTROLS[name], getattr(params, name)
        bad = _outside(values, control.range)
        if (i := _first(bad)) is not None:
            raise RowsRefused(
                f"sampling[{i}].{name} = {values[i].item()} is invalid: it must be {control.allowed()}",
                sequences[bad].tolist(),
            )
    bias = CONTROLS["logit_bias"]
    bad = _outside(params.bias_values, bias.range)
    if (i := _first(bad)) is not None:
        raise RowsRefused(
            f"sampling[{int(params.bias_rows[i])}].logit_bias[{int(params.bias_ids[i])}] = "
            f"{params.bias_values[i].item()} is invalid: biases lie {bias.allowed()}",
            sequences[params.bias_rows[bad]].tolist(),
        )


def _check_token_lists(params: SamplingBatch, vocab_size: int, sequences: torch.Tensor) -> None:
    """logit_bias and suppressed ids inside the vocabulary; the history and generated counts well formed."""
    num_rows = len(params.seeds)
    for name, rows, ids in (
        ("logit_bias", params.bias_rows, params.bias_ids),
        ("suppress_token_ids", params.suppress_rows, params.suppress_ids),
    ):
        bad = (ids < 0) | (ids >= vocab_size)
        if (i := _first(bad)) is not None:
            raise RowsRefused(
                f"sampling[{int(rows[i])}].{name} has token id {int(ids[i])}, outside the vocabulary "
                f"[0, {vocab_size})",
                sequences[rows[bad]].tolist(),
            )
    if (params.min_tokens > 0).any() and len(params.output_lens) != num_rows:
        raise InvalidArgument(
            f"output_lens has {len(params.output_lens)} entries for {num_rows} sampling rows: min_tokens "
            "needs each row's generated token count"
        )
    if len(params.output_lens) not in (0, num_rows):
        raise InvalidArgument(f"output_lens must be empty or {num_rows} counts >= 0, one per sampling row")
    if (row := _first(params.output_lens < 0)) is not None:
        raise RowsRefused(
            f"output_lens must be empty or {num_rows} counts >= 0, one per sampling row; "
            f"output_lens[{row}] is {int(params.output_lens[row])}",
            sequences[params.output_lens < 0].tolist(),
        )


def _check_history(params: SamplingBatch, vocab_size: int, sequences: torch.Tensor) -> None:
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
    if len(prompt_lens) != num_rows:
        raise InvalidArgument(f"history_prompt_lens needs one count per sampling row ({num_rows})")
    bad = (prompt_lens < 0) | (prompt_lens > cu.diff())
    if (row := _first(bad)) is not None:
        raise RowsRefused(
            f"history_prompt_lens[{row}] = {int(prompt_lens[row])} must lie between 0 and the length of the "
            f"row's history ({int(cu[row + 1] - cu[row])})",
            sequences[bad].tolist(),
        )
    outside = (history < 0) | (history >= vocab_size)
    if (t := _first(outside)) is not None:
        row_of = torch.repeat_interleave(torch.arange(num_rows), cu.diff(), output_size=len(history))
        raise RowsRefused(
            f"history_token_ids[{t}] = {int(history[t])} is outside the vocabulary [0, {vocab_size})",
            sequences[row_of[outside]].tolist(),
        )
