"""A multi-step: an all-decode step sent as one Compute.ForwardSteps call that runs up to k steps, with
compute feeding each row's sampled token into the next step, so the round trip between gateway and compute
is paid once per call instead of once per token. Each step's tokens still stream back as it finishes. Here:
which steps may run so, where compute stops each row, the call's first message, and the reply deadline."""

import threading
import time
from dataclasses import dataclass

import grpc

from gateway.forward import forward_request
from gateway.scheduler import Scheduler
from gateway.sequence import Sampling, Sequence
from gateway.step import ScheduledStep
from protos import compute_pb2


@dataclass(frozen=True, slots=True)
class RowLimit:
    """Where compute stops a row: after `max_steps` steps, or after sampling one of `stop_ids` (each reply
    says which rows it runs on: ForwardResponse.running)."""

    max_steps: int
    stop_ids: frozenset[int]


def can_multi_step(seqs: list[Sequence]) -> bool:
    """Whether the step can run as several: every row decodes one token and samples it, none forks, none is
    constrained (its next mask follows the token it samples: gateway.structured)."""
    return all(
        seq.is_decode and seq.samples_now and not seq.forks_now and seq.constraint is None for seq in seqs
    )


def multi_steps(step: ScheduledStep, scheduler: Scheduler, max_steps: int, news: bool) -> int:
    """How many steps an all-decode step may run as one multi-step call (1: a plain Forward): while no request
    waits (for room the lookahead blocks would hold) or is new (`news`), `max_steps`, halved until the slots
    its rows may still write fit above the watermark."""
    kv = scheduler.kv
    if max_steps <= 1 or news or scheduler.waiting:
        return 1
    if not can_multi_step(step.seqs) or not all(map(kv.holds, step.seqs)):
        return 1
    room, steps = kv.available_blocks - scheduler.watermark, max_steps
    while steps > 1 and sum(kv.blocks_needed(s, s.chunk_end + s.lookahead(steps)) for s in step.seqs) > room:
        steps //= 2
    return steps


def row_limit(seq: Sequence, steps: int, eos_ids: frozenset[int]) -> RowLimit:
    """A row goes at most `steps` steps and never past its max_tokens or the longest sequence; it stops on
    the ids that end it (EOS unless ignore_eos) once min_tokens is reached (before, they are suppressed)."""
    s = seq.sampling
    stop_ids = s.stop_token_ids if s.ignore_eos else s.stop_token_ids | eos_ids
    return RowLimit(seq.lookahead(steps) + 1, frozenset(stop_ids))


def multi_step_request(
    seqs: list[Sequence],
    tables: list[list[list[int]]],
    epoch: str,
    eos_ids: frozenset[int],
    limits: list[RowLimit],
    session_epoch: int = 0,
) -> compute_pb2.StepsRequest:
    """The call's first message: the step as a Forward would send it, and each row's limit."""
    request = compute_pb2.StepsRequest(
        first=forward_request(seqs, tables, epoch, eos_ids, session_epoch),
        max_steps=[limit.max_steps for limit in limits],
        cu_stop_token_ids=[0],
    )
    for limit in limits:
        request.stop_token_ids.extend(sorted(limit.stop_ids))
        request.cu_stop_token_ids.append(len(request.stop_token_ids))
    return request


def with_lookup(request: compute_pb2.StepsRequest, seqs: list[Sequence], draft_tokens: int) -> None:
    """Each row's tokens so far as its lookup tokens, when the call may draft: draft_tokens > 0 and every row
    plain greedy (compute checks that itself, min_tokens included: it drafts only for plain greedy rows)."""
    if not draft_tokens or not all(_plain_greedy(seq.sampling) for seq in seqs):
        return
    request.draft_tokens = draft_tokens
    request.cu_lookup_token_ids.append(0)
    for seq in seqs:
        request.lookup_token_ids.extend(seq.prompt_ids)
        request.lookup_token_ids.extend(seq.output_ids)
        request.cu_lookup_token_ids.append(len(request.lookup_token_ids))


def _plain_greedy(s: Sampling) -> bool:
    return s.temperature == 0 and s.logprobs is None and not s.penalized and not s.logit_bias


def select_rows(
    reply: compute_pb2.ForwardResponse, seqs: list[Sequence], keep: list[bool]
) -> compute_pb2.ForwardResponse:
    """The reply's tokens (and logprobs) of the sampling rows `seqs` that `keep` marks, in order."""
    if all(keep):
        return reply
    width, part, asked = reply.top_logprobs_width, compute_pb2.ForwardResponse(), 0
    part.top_logprobs_width = width
    for seq, kept, token, logprob in zip(seqs, keep, reply.token_ids, reply.logprobs, strict=True):
        span = slice(asked * width, (asked + 1) * width)
        if kept:
            part.token_ids.append(token)
            part.logprobs.append(logprob)
            if seq.sampling.logprobs is not None:
                part.top_token_ids.extend(reply.top_token_ids[span])
                part.top_logprobs.extend(reply.top_logprobs[span])
        asked += seq.sampling.logprobs is not None
    return part


class ReplyDeadline:
    """Cancels a streaming call whose next reply does not come within `seconds` of the last one (or of
    the start): each step of a ForwardSteps call gets a step's deadline, not the whole call's. One thread
    per call; `expired` tells that it cancelled the call."""

    def __init__(self, call: grpc.Future, seconds: float) -> None:
        self.expired = False
        self._call, self._seconds = call, seconds
        self._due = time.monotonic() + seconds
        self._done = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="multi-step-deadline").start()

    def replied(self, seconds: float) -> None:
        """A reply came; the next one has `seconds`."""
        self._due = time.monotonic() + seconds

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(max(0.0, self._due - time.monotonic())):
            if time.monotonic() >= self._due:
                self.expired = True
                self._call.cancel()
                return


class StepExpired(grpc.RpcError):
    """What a ForwardSteps call cancelled by its ReplyDeadline counts as: DEADLINE_EXCEEDED (compute lost)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self._seconds = seconds

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return f"no reply of compute's ForwardSteps call within the step deadline ({self._seconds:.1f} s)"

    def trailing_metadata(self) -> tuple:
        return ()
