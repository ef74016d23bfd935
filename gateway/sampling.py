"""Sampling controls: the public request's resolved and checked, the compute step's built, logprobs read."""

import math
from itertools import accumulate

from common.errors import InvalidArgument
from common.sampling_limits import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_STOP_STRINGS
from gateway.sequence import Sampling, Sequence
from protos import common_pb2, compute_pb2, generation_pb2

MAX_SAMPLES = 16


def resolve_sampling(params: common_pb2.SamplingParams, vocab_size: int) -> Sampling:
    """Defaults filled in and every value checked; InvalidArgument names the field to fix."""
    max_tokens = params.max_tokens if params.HasField("max_tokens") else 16
    temperature = params.temperature if params.HasField("temperature") else 1.0
    top_p = params.top_p if params.HasField("top_p") else 1.0
    if max_tokens <= 0:
        raise InvalidArgument(f"sampling.max_tokens must be > 0, got {max_tokens}")
    if temperature < 0:
        raise InvalidArgument(f"sampling.temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {top_p}")
    n = params.n if params.HasField("n") else 1
    if not 1 <= n <= MAX_SAMPLES:
        raise InvalidArgument(f"sampling.n must be in [1, {MAX_SAMPLES}], got {n}")
    if params.top_k < 0:
        raise InvalidArgument(f"sampling.top_k must be >= 0 (0 turns it off), got {params.top_k}")
    _check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    _check_processors(params, max_tokens, vocab_size)
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=params.top_k,
        seed=params.seed if params.HasField("seed") else None,
        ignore_eos=params.ignore_eos,
        stop_token_ids=frozenset(params.stop_token_ids),
        n=n,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        min_tokens=params.min_tokens,
        stop=tuple(params.stop),
    )


def _check_token_ids(name: str, ids, vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"sampling.{name} has {bad[0]}, outside the vocabulary [0, {vocab_size})")


def _check_processors(params: common_pb2.SamplingParams, max_tokens: int, vocab_size: int) -> None:
    if not 0 <= params.min_p <= 1:
        raise InvalidArgument(f"sampling.min_p must be in [0, 1] (0 turns it off), got {params.min_p}")
    if params.HasField("repetition_penalty") and not 0 < params.repetition_penalty < math.inf:
        raise InvalidArgument(
            f"sampling.repetition_penalty must be > 0 (1 turns it off, > 1 discourages repeats), "
            f"got {params.repetition_penalty}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if not -MAX_PENALTY <= getattr(params, name) <= MAX_PENALTY:
            raise InvalidArgument(
                f"sampling.{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(params, name)}"
            )
    _check_token_ids("logit_bias", params.logit_bias.keys(), vocab_size)
    for token, bias in params.logit_bias.items():
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidArgument(
                f"sampling.logit_bias[{token}] = {bias}: biases must be in "
                f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"
            )
    if params.HasField("logprobs") and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(
            f"sampling.logprobs must be in [0, {MAX_LOGPROBS}] (top alternatives per token), "
            f"got {params.logprobs}"
        )
    if not 0 <= params.min_tokens <= max_tokens:
        raise InvalidArgument(
            f"sampling.min_tokens must be in [0, max_tokens = {max_tokens}], got {params.min_tokens}"
        )
    if len(params.stop) > MAX_STOP_STRINGS or not all(params.stop):
        raise InvalidArgument(
            f"sampling.stop takes at most {MAX_STOP_STRINGS} non-empty strings, got {list(params.stop)[:20]}"
        )


# the compute step
def forward_sampling(seqs: list[Sequence], eos_ids: frozenset[int]) -> dict:
    """ForwardRequest fields for sampling rows `seqs`: their parameters, and the token history and
    generated counts only rows with penalties or a pending min_tokens need."""
    fields = {"sampling": [sampling_proto(seq, eos_ids) for seq in seqs]}
    if any(seq.sampling.penalized for seq in seqs):
        histories = [_history(seq) for seq in seqs]
        fields["history_token_ids"] = [t for tokens, _ in histories for t in tokens]
        fields["cu_history"] = [0, *accumulate(len(tokens) for tokens, _ in histories)]
        fields["history_prompt_lens"] = [prompt_len for _, prompt_len in histories]
    if not all(seq.reached_min_tokens for seq in seqs):
        fields["output_lens"] = [len(seq.output_ids) for seq in seqs]
    return fields


def sampling_proto(seq: Sequence, eos_ids: frozenset[int]) -> common_pb2.SamplingParams:
    s = seq.sampling
    proto = common_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=s.logit_bias,
    )
    # NOTE: sampling.n, stop strings and max_tokens are the gateway's business; compute samples one token.
    for name, value, off in (
        ("seed", s.seed, None),
        ("min_p", s.min_p, 0.0),
        ("repetition_penalty", s.repetition_penalty, 1.0),
        ("logprobs", s.logprobs, None),
    ):
        if value != off:
            setattr(proto, name, value)
    if not seq.reached_min_tokens:
        proto.min_tokens = s.min_tokens
        proto.stop_token_ids.extend(s.stop_token_ids if s.ignore_eos else s.stop_token_ids | eos_ids)
    return proto


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
