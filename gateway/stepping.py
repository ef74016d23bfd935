"""The engine's step: one Cache.Reserve (or Free of the preempted), one Compute.Forward (or, for decodes,
one ForwardSteps running several steps), then the sampled tokens appended, finished sequences released and
outputs handed to their requests."""

import threading
import time
from collections.abc import Iterator

import grpc
import structlog

from common.errors import PagedServeError, from_rpc_error, refused_rows
from common.server import request_metadata
from gateway.config import FAIL_STEP_ENV
from gateway.decode_steps import (
    ReplyDeadline,
    RowLimit,
    StepExpired,
    eligible,
    row_limit,
    select_rows,
    steps_request,
)
from gateway.forward import forward_rows
from gateway.outputs import Output, advance
from gateway.recovery import PeerFault, calling
from gateway.scheduler import ScheduledStep
from gateway.sequence import Sequence
from gateway.step_timer import StepTimer
from protos import compute_pb2

log = structlog.get_logger()


class Stepping:
    """The step half of gateway.engine.Engine, which owns the state it uses (kv, scheduler, lease, the
    compute stub and steps, model_info, handle, view, _by_id, _intake, _steps_stop: set to end a running
    ForwardSteps call) and the request lifecycle (_release, _fail, _fail_internal, _lose)."""

    def _run_step(self, step: ScheduledStep, timer: StepTimer) -> None:
        """One step: the cache reserves its blocks (or frees the preempted), compute runs it, then the
        tokens are appended. A lost peer stops the loop's stepping until it is back (see _recover); another
        failed call ends the step's sequences with the error, and any other exception with INTERNAL."""
        seqs = step.seqs or step.preempted
        try:
            self._step(step, timer)
        except PeerFault as fault:
            if fault.lost:
                self._lose(fault.service)
            else:
                self._fail(seqs, from_rpc_error(fault.err))
        except Exception as exc:  # noqa: BLE001 - one step's fault must not end the loop
            self._fail_internal(seqs, exc)

    def _step(self, step: ScheduledStep, timer: StepTimer) -> None:
        kind = "decode" if step.is_decode else "prefill"
        with timer.phase("cache_rpc"):
            if step.preempted:
                with calling("cache"):
                    self.kv.free(step.preempted)
                log.info("preempted", seq_ids=[s.seq_id for s in step.preempted])
                return
            steps = self._reserve(step, self._decode_steps(step) - 1) + 1
        if not step.seqs:
            return
        chunks = [[s.request_id, s.index, s.chunk_len] for s in step.seqs]
        log.debug("step", chunks=chunks)
        if self._fail_step in {seq.request_id for seq in step.seqs}:
            raise RuntimeError(f"injected step fault ({FAIL_STEP_ENV})")
        if not self.lease.held():  # the blocks may be another gateway's by now: compute must not write them
            self._lose("cache")
            return
        if steps > 1 and self._run_steps(step.seqs, steps, timer):
            return
        with timer.phase("compute_rpc"):
            seqs, reply = forward_rows(step.seqs, self._forward, self._refuse)
        if reply is None:
            return
        with timer.phase("cache_rpc"), calling("cache"):
            for seq in [seq for seq in seqs if seq.forks_now]:
                self._fork(seq)
        self._advance(seqs, reply)
        timer.compute = reply
        timer.finish(kind)

    def _reserve(self, step: ScheduledStep, lookahead: int = 0) -> int:
        """The step's Reserve, with slots for `lookahead` more tokens per sequence (a ForwardSteps call's);
        returns the lookahead reserved (0 if the blocks for it were short). One refused for want of blocks
        (the admission counted on a stale Lookup) undoes the step's admissions: those sequences wait again,
        and the step runs the others. The cache changed nothing (a Reserve is all or nothing), so no block
        is leaked."""
        try:
            with calling("cache"):
                self.kv.reserve(step.seqs, lookahead)
            return lookahead
        except PeerFault as fault:
            if lookahead and not fault.lost and fault.err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return self._reserve(step)
            new = [seq for seq in step.seqs if not self.kv.holds(seq)]
            if fault.lost or fault.err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or not new:
                raise
            log.warning("admission_undone", seq_ids=[s.seq_id for s in new], error=fault.err.details())
            self._undo_admissions(step, new)
            return 0

    def _undo_admissions(self, step: ScheduledStep, new: list[Sequence]) -> None:
        """The step's new sequences wait again; the others are reserved alone (the step list shrinks in
        place: a failure from here on fails only them)."""
        self.scheduler.unadmit(new)
        step.seqs[:] = [seq for seq in step.seqs if self.kv.holds(seq)]
        if step.seqs:
            with calling("cache"):
                self.kv.reserve(step.seqs)

    def _decode_steps(self, step: ScheduledStep) -> int:
        """How many steps an all-decode step may run as one ForwardSteps call (1: a plain Forward): up to
        --decode-steps, while no request waits (for room the lookahead blocks would hold) or is new, and the
        slots fit above the watermark."""
        steps = self.config.decode_steps
        if steps <= 1 or self._intake or self.scheduler.waiting:
            return 1
        if not eligible(step.seqs) or not all(map(self.kv.holds, step.seqs)):
            return 1
        need = sum(self.kv.blocks_needed(seq, seq.chunk_end + steps - 1) for seq in step.seqs)
        return steps if need <= self.kv.available_blocks - self.scheduler.watermark else 1

    def _run_steps(self, seqs: list[Sequence], steps: int, timer: StepTimer) -> bool:
        """The decode step of `seqs` and up to steps - 1 more in one ForwardSteps call, each step's tokens
        handled as it comes (one StepTimer each). False if compute refused the call before running a step
        (the caller then sends the step as a Forward, which handles refusals)."""
        eos = frozenset(self.model_info.eos_token_ids)
        limits = [row_limit(seq, steps, eos) for seq in seqs]
        tables = [self.kv.block_table(seq) for seq in seqs]
        request = steps_request(seqs, tables, self.handle.epoch, eos, limits)
        self._steps.marked(seqs, request.first)
        stop = self._steps_stop = threading.Event()
        taken, held, ran, step_s = [0] * len(seqs), [], 0, self._steps.step_timeout(len(seqs))
        deadline = None
        try:
            with calling("compute"):
                replies = self._compute.ForwardSteps(
                    _messages(request, stop),
                    timeout=step_s * steps,
                    metadata=request_metadata(seq.request_id for seq in seqs),
                )
                deadline = ReplyDeadline(replies, step_s)
                while True:
                    with timer.phase("compute_rpc"):
                        reply = next(replies, None)
                    if reply is None:
                        return True
                    ran += 1
                    deadline.replied(step_s)
                    self._steps.observe(time.perf_counter() - timer.start, len(reply.rows))
                    held += self._step_of_steps(seqs, reply, limits, taken, stop)
                    timer.compute = reply
                    timer.finish("decode")
                    timer = StepTimer()
        except PeerFault as fault:
            if deadline is not None and deadline.expired:
                raise PeerFault("compute", StepExpired(step_s)) from fault
            if ran == 0 and not fault.lost and refused_rows(fault.err):
                return False
            raise
        finally:
            if deadline is not None:
                deadline.close()
            stop.set()
            self._steps_stop = None
            self._release([seq for seq, _ in held])
            for seq, output in held:
                seq.outbox.put(output)

    def _step_of_steps(
        self,
        seqs: list[Sequence],
        reply: compute_pb2.ForwardResponse,
        limits: list[RowLimit],
        taken: list[int],
        stop: threading.Event,
    ) -> list[tuple[Sequence, Output]]:
        """One reply of a ForwardSteps call: its tokens appended (rows the gateway ended meanwhile skip
        theirs). A sequence that ended where compute stops its row too is released now; one compute still
        runs (a stop string) ends the call and is returned, to be released once the call is over. (No request
        waits for the room it frees: a call starts only when none waits, and a new one ends it.)"""
        live = [seqs[row] for row in reply.rows]
        for row in reply.rows:
            taken[row] += 1
        keep = [seq.finish_reason is None and seq.seq_id in self._by_id for seq in live]
        rows = [row for row, kept in zip(reply.rows, keep, strict=True) if kept]
        for row in rows:
            seqs[row].chunk_end = seqs[row].num_computed + 1
        eos = frozenset(self.model_info.eos_token_ids)
        outputs = advance([seqs[row] for row in rows], select_rows(reply, live, keep), eos, self.tokenizer)
        self.view.account(outputs)
        ended = [row for row, (_, output) in zip(rows, outputs, strict=True) if output.finish_reason]
        done = {row for row in ended if limits[row].stops(taken[row], seqs[row].output_ids[-1])}
        held = [(seqs[row], outputs[i][1]) for i, row in enumerate(rows) if row in ended and row not in done]
        if held:
            stop.set()
        self._release([seqs[row] for row in done])
        for row, (seq, output) in zip(rows, outputs, strict=True):
            if row not in ended or row in done:
                seq.outbox.put(output)
        return held

    def _forward(self, seqs: list[Sequence]) -> compute_pb2.ForwardResponse:
        tables = [self.kv.block_table(seq) for seq in seqs]
        eos = frozenset(self.model_info.eos_token_ids)
        return self._steps.send(self._compute, seqs, tables, self.handle.epoch, eos)

    def _refuse(self, seqs: list[Sequence], error: PagedServeError) -> set[str]:
        """Compute refused these rows alone: their requests (every sample) fail; returns the seq ids ended."""
        groups = {seq.group_id for seq in seqs}
        ended = [seq for seq in self._by_id.values() if seq.group_id in groups]
        self._fail(ended, error)
        return {seq.seq_id for seq in ended}

    def _fork(self, parent: Sequence) -> None:
        """After the prompt's prefill, samples 1..n-1 share the parent's blocks and run beside it."""
        children = parent.fork()
        self.kv.fork(parent, children)
        for child in children:
            self._by_id[child.seq_id] = child
        self.scheduler.add_running(children)

    def _advance(self, seqs: list[Sequence], reply: compute_pb2.ForwardResponse) -> None:
        eos = frozenset(self.model_info.eos_token_ids)
        outputs = advance(seqs, reply, eos, self.tokenizer)
        self.view.account(outputs)
        # NOTE: blocks are back in the pool before the client hears that its request ended.
        self._release([seq for seq, output in outputs if output.finish_reason])
        for seq, output in outputs:
            seq.outbox.put(output)


def _messages(first: compute_pb2.StepsRequest, stop: threading.Event) -> Iterator[compute_pb2.StepsRequest]:
    """A ForwardSteps call's requests: the first step, then the half-close once `stop` is set (compute then
    stops after the step it runs)."""
    yield first
    stop.wait()
