"""Resuming a broken stream (GenerateRequest.resume): the request's samples still to generate, each holding
the tokens its client received and the state the unbroken stream had after them.

A resumed sample is a sequence whose output is already partly there, as a preempted one is: the engine
prefills the prompt and those tokens (the prefix cache serves the blocks another gateway wrote), then samples
on. Everything the next token depends on follows from them: positions, the penalties' history, min_tokens
and max_tokens counts, and the seeded draw (compute derives it from the seed and the position alone). The
text stream is rebuilt by passing the received tokens through the same path, one by one, the text they
release dropped: it releases next exactly what the unbroken stream would have, nothing twice.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from common.errors import Aborted, InvalidArgument
from gateway.admission import Admission
from gateway.outputs import append_token
from gateway.sequence import Sequence
from gateway.tokenizer import check_vocabulary
from protos import generation_pb2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TAKEN_OVER = "request {} was resumed by another call (GenerateRequest.resume): this stream ends here"


@dataclass(frozen=True)
class Samples:
    """The sequences to run, and per resumed sample the text its received tokens released (what its client
    has, for the tool-call parser to go on from)."""

    seqs: list[Sequence]
    texts: dict[int, str] = field(default_factory=dict)


def samples(
    first: Sequence,
    resume: list[generation_pb2.ResumedSample],
    eos: frozenset[int],
    tokenizer: "PreTrainedTokenizerBase",
    vocab_size: int,
) -> Samples:
    """The sequences to run for the request whose sample 0 is `first`: `first` alone without `resume`,
    else one per sample not finished (as a forked one: sample i seeded with seed + i, its own constraint
    state), its received tokens appended. INVALID_ARGUMENT, nothing changed, for a resume that is no stream
    this request produced."""
    if not resume:
        return Samples([first])
    received, seqs, texts = _received(first, resume, vocab_size), [], {}
    for index in range(first.sampling.n):
        if index not in _finished(resume):
            seq, texts[index] = _resumed(first, index, received.get(index, []), eos, tokenizer)
            seqs.append(seq)
    return Samples(seqs, texts)


def finished_tokens(resume: Iterable[generation_pb2.ResumedSample]) -> int:
    """The completion tokens of the samples the client received whole (their usage counts them once)."""
    return sum(len(sample.token_ids) for sample in resume if sample.finished)


def take_over(admission: Admission, request_id: str, tenant: str) -> int:
    """A resumed request replaces a running one of its id and API key on this gateway: that one's stream
    ends with ABORTED, and its sequences are freed as its call ends (its client is gone: its stream broke).
    Returns how many it ended."""
    running = admission.running_requests(request_id, tenant)
    for seq in running:
        seq.outbox.put(Aborted(TAKEN_OVER.format(request_id)))
    return len(running)


def _finished(resume: list[generation_pb2.ResumedSample]) -> set[int]:
    return {sample.index for sample in resume if sample.finished}


def _received(
    first: Sequence, resume: list[generation_pb2.ResumedSample], vocab_size: int
) -> dict[int, list[int]]:
    """The received token ids by sample index, checked: indices in range and unique, ids in the
    vocabulary, something left to generate."""
    n, received = first.sampling.n, {}
    for i, sample in enumerate(resume):
        if not 0 <= sample.index < n:
            raise InvalidArgument(f"resume[{i}].index is {sample.index}: the request has samples 0..{n - 1}")
        if sample.index in received:
            raise InvalidArgument(f"resume[{i}]: sample {sample.index} is listed twice")
        received[sample.index] = list(sample.token_ids)
        check_vocabulary(received[sample.index], vocab_size, f"resume[{i}].token_ids: ")
        if len(sample.token_ids) + len(first.prompt_ids) >= first.max_len and not sample.finished:
            raise InvalidArgument(
                f"resume[{i}]: sample {sample.index} has {len(sample.token_ids)} tokens after a "
                f"{len(first.prompt_ids)}-token prompt; at most {first.max_len} fit a sequence"
            )
    if len(_finished(resume)) == n:
        raise InvalidArgument("resume: every sample is finished; there is nothing to generate")
    return received


def _resumed(
    first: Sequence, index: int, tokens: list[int], eos: frozenset[int], tokenizer: "PreTrainedTokenizerBase"
) -> tuple[Sequence, str]:
    # NOTE: n = 1: the samples are there already, none forks the others.
    seq, text = first.sample(index, sampling=replace(first.sampling.of_sample(index), n=1), text=None), ""
    for count, token in enumerate(tokens, 1):
        text += append_token(seq, token, eos, tokenizer)
        if seq.finish_reason:
            raise InvalidArgument(
                f"resume: sample {index}'s token {count} of {len(tokens)} ends it ({seq.finish_reason}): a "
                "sample whose last response was received is sent with finished: true"
            )
    return seq, text
