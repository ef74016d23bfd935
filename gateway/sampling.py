"""Sampling controls: the public request's resolved and checked, the compute step's built, logprobs read."""

from itertools import accumulate

from common.errors import InvalidArgument
from common.sampling_controls import CONTROLS, ROW_CONTROLS, Control, Kind, read
from gateway.sequence import Sampling, Sequence
from gateway.structured.matcher import packed
from protos import compute_pb2, generation_pb2


def resolve_sampling(params: generation_pb2.SamplingParams, vocab_size: int) -> Sampling:
    """Defaults filled in and every value checked; InvalidArgument names the field to fix."""
    values = {name: read(params, control) for name, control in CONTROLS.items()}
    for control in CONTROLS.values():
        _check(control, values, vocab_size)
    return Sampling(**values)


def _check(control: Control, values: dict, vocab_size: int) -> None:
    """Raises InvalidArgument unless the control's value lies in its declared range."""
    name, value = control.name, values[control.name]
    if control.kind is Kind.TOKEN_IDS:
        _check_token_ids(name, value, vocab_size)
    elif control.kind is Kind.TOKEN_BIAS:
        _check_token_ids(name, value.keys(), vocab_size)
        for token, bias in value.items():
            if not control.range.holds(bias, values):
                raise InvalidArgument(
                    f"sampling.{name}[{token}] = {bias}: biases must be {control.allowed()}"
                )
    elif control.kind is Kind.STRINGS:
        if not control.range.holds(len(value), values) or not all(value):
            raise InvalidArgument(
                f"sampling.{name} takes at most {control.range.high} non-empty strings, "
                f"got {list(value)[:20]}"
            )
    elif control.range is not None and value is not None and not control.range.holds(value, values):
        raise InvalidArgument(f"sampling.{name} must be {control.allowed(values)}, got {value}")


def _check_token_ids(name: str, ids, vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"sampling.{name} has {bad[0]}, outside the vocabulary [0, {vocab_size})")


# the compute step
def forward_sampling(seqs: list[Sequence], eos_ids: frozenset[int]) -> dict:
    """ForwardRequest fields for sampling rows `seqs`: their parameters, the token history and generated
    counts only rows with penalties or a pending min_tokens need, and the constrained rows' masks."""
    fields = {"sampling": [row_sampling(seq, eos_ids) for seq in seqs]}
    if any(seq.sampling.penalized for seq in seqs):
        histories = [_history(seq) for seq in seqs]
        fields["history_token_ids"] = [t for tokens, _ in histories for t in tokens]
        fields["cu_history"] = [0, *accumulate(len(tokens) for tokens, _ in histories)]
        fields["history_prompt_lens"] = [prompt_len for _, prompt_len in histories]
    if not all(seq.reached_min_tokens for seq in seqs):
        fields["output_lens"] = [len(seq.output_ids) for seq in seqs]
    constrained = [row for row, seq in enumerate(seqs) if seq.constraint is not None]
    if constrained:
        fields["constraint_rows"] = constrained
        fields["constraint_bitmask"] = packed([seqs[row].constraint for row in constrained])
    return fields


def row_sampling(seq: Sequence, eos_ids: frozenset[int]) -> compute_pb2.RowSampling:
    """The row's controls that differ from their defaults (compute fills in the same defaults)."""
    s = seq.sampling
    row = compute_pb2.RowSampling(
        **{c.name: getattr(s, c.name) for c in ROW_CONTROLS if getattr(s, c.name) != c.default}
    )
    # NOTE: min_tokens goes only while pending, with the ids it suppresses.
    if seq.reached_min_tokens:
        row.ClearField("min_tokens")
    else:
        row.suppress_token_ids.extend(s.stop_token_ids if s.ignore_eos else s.stop_token_ids | eos_ids)
    return row


def _history(seq: Sequence) -> tuple[list[int], int]:
    """The tokens a row's penalties look at, and how many of them are prompt tokens."""
    s = seq.sampling
    if s.repetition_penalty != 1:
        return seq.token_ids, len(seq.prompt_ids)
    return (seq.output_ids, 0) if s.penalized else ([], 0)


def token_logprobs(
    reply: compute_pb2.ForwardResponse, seqs: list[Sequence]
) -> list[generation_pb2.TokenLogprobs | None]:
    """Per sampling row: its token's logprob and top alternatives, or None where it asked for none."""
    width, row, out = reply.top_logprobs_width, 0, []
    for seq, token, logprob in zip(seqs, reply.token_ids, reply.logprobs, strict=True):
        n = seq.sampling.logprobs
        if n is None:
            out.append(None)
            continue
        start = row * width
        out.append(
            generation_pb2.TokenLogprobs(
                token_id=token,
                logprob=logprob,
                top_token_ids=reply.top_token_ids[start : start + n],
                top_logprobs=reply.top_logprobs[start : start + n],
            )
        )
        row += 1
    return out
