"""One request's sequences as the engine serves them (gateway.generation made them): admitted and submitted,
then each Output the engine hands over turned into the public GenerateResponse, usage and times added as
each sample finishes."""

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import structlog

from gateway import metrics, prompt_scores, resume
from gateway.outputs import Output
from gateway.reasoning.stream import ReasoningStreams
from gateway.sequence import Sequence
from gateway.tools.stream import CallStreams
from protos import generation_pb2

if TYPE_CHECKING:
    from gateway.generation import Generation

log = structlog.get_logger()
FINISH_REASONS = {"length": generation_pb2.FINISH_REASON_LENGTH, "stop": generation_pb2.FINISH_REASON_STOP}
# Registers a callback to run when the call ends, whatever the reason (gRPC: context.add_callback).
OnEnd = Callable[[Callable[[], None]], object]


class Started:
    """One prompt's request: its sequences (sample 0, or the resumed samples), submitted to the engine by
    `submit`, then its responses by `reply`, per Output, until `running` samples finished."""

    def __init__(
        self,
        seq: Sequence,
        resumed: resume.Samples,
        reasoning: ReasoningStreams | None,
        calls: CallStreams | None,
        timer,
        resuming: bool,
    ) -> None:
        self.seq, self.samples, self.reasoning, self.calls = seq, resumed.seqs, reasoning, calls
        self.timer = timer
        self.resuming = resuming
        # NOTE: a resumed sample's usage counts the tokens its client received before too.
        self.completion_tokens = {sample.index: len(sample.output_ids) for sample in resumed.seqs}
        # NOTE: unresumed, sample 0 forks the others: its n samples all end here.
        self.running = len(resumed.seqs) if resuming else seq.sampling.n
        self._by_index = {sample.index: sample for sample in resumed.seqs}
        self._first_token_at: float | None = None
        self._scores_prompt = seq.sampling.prompt_logprobs is not None

    def submit(self, generation: "Generation", on_end: OnEnd, outbox=None) -> None:
        """Admits the request and hands its sequences to the engine, their Outputs to `outbox` (None: the
        sequence's own)."""
        seq = self.seq
        if self.resuming:
            metrics.RESUMED.inc()
            ended = resume.take_over(generation.admission, seq.request_id, seq.tenant)
            log.info("resumed", received_tokens=self.completion_tokens, taken_over=ended)
        for sample in self.samples:
            sample.outbox = outbox or sample.outbox
        generation.admission.enter(seq)
        on_end(lambda: generation.admission.leave(seq.seq_id))
        log.info("request", prompt_tokens=len(seq.prompt_ids), n=seq.sampling.n, seq_id=seq.seq_id)
        for sample in self.samples:
            generation.engine.submit(sample)
        on_end(lambda: generation.engine.abort(seq.group_id))

    def replies(self) -> Iterator[generation_pb2.GenerateResponse]:
        """The responses until every sample finished, or the request's error."""
        while self.running:
            yield self.reply(self.seq.outbox.get())

    def reply(self, item: Output | Exception) -> generation_pb2.GenerateResponse:
        """The response of one Output (raises an error item); `reasoning` moves the reasoning out of its text,
        then `calls` the tool calls. With max_tokens 0 the one token each sample sampled is not returned."""
        if isinstance(item, Exception):
            raise item
        if self.seq.sampling.max_tokens == 0:
            item = replace(item, token_ids=[], text="", logprobs=None, finish_reason="length")
        now = self.timer.token()
        self._first_token_at = self._first_token_at or now
        self.completion_tokens[item.index] = self.completion_tokens.get(item.index, 0) + len(item.token_ids)
        reply = _response(item, self.seq)
        if item.index == 0 and self._scores_prompt:
            # NOTE: sample 0's first token: its prompt was scored in the steps before (gateway.prompt_scores).
            self._scores_prompt = False
            reply.prompt_token_ids.extend(self.seq.prompt_ids)
            reply.prompt_logprobs.extend(prompt_scores.handed(self.seq))
        if self.reasoning is not None:
            self.reasoning.apply(reply)
        if self.calls is not None:
            self.calls.apply(reply)
        if item.finish_reason:
            # NOTE: forked samples have sample 0's prompt, cached tokens and times.
            sample = self._by_index.get(item.index, self.seq)
            reply.usage.CopyFrom(_usage(sample, self.completion_tokens[item.index]))
            reply.timings.CopyFrom(_timings(sample, self._first_token_at, now))
            self.running -= 1
            if not self.running:
                self._finish(item.finish_reason)
        return reply

    def _finish(self, finish_reason: str) -> None:
        seq = self.seq
        self.timer.finish(finish_reason, len(seq.prompt_ids), self.samples[0].scheduled_at - seq.arrival)
        log.info(
            "finished", finish_reason=finish_reason, completion_tokens=sum(self.completion_tokens.values())
        )


def _response(item: Output, seq: Sequence) -> generation_pb2.GenerateResponse:
    reply = generation_pb2.GenerateResponse(
        request_id=seq.request_id,
        token_ids=item.token_ids,
        text=item.text,
        index=item.index,
        logprobs=item.logprobs,
    )
    if item.finish_reason:
        reply.finish_reason = FINISH_REASONS[item.finish_reason]
    return reply


def _usage(seq: Sequence, completion_tokens: int) -> generation_pb2.Usage:
    """A sample's usage: cached_tokens counts the prompt's only (a resumed sample's received tokens may be
    cached too)."""
    prompt_tokens = len(seq.prompt_ids)
    return generation_pb2.Usage(
        prompt_tokens=prompt_tokens,
        cached_tokens=min(seq.cached_tokens, prompt_tokens),
        completion_tokens=completion_tokens,
    )


def _timings(seq: Sequence, first_token_at: float, now: float) -> generation_pb2.Timings:
    return generation_pb2.Timings(
        queue_s=seq.scheduled_at - seq.arrival,
        time_to_first_token_s=first_token_at - seq.arrival,
        total_s=now - seq.arrival,
    )
