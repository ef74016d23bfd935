"""One step of the engine, from its schedule to its outputs, and its faults (gateway/step_faults.py):

    schedule  the Lookup of the prefixes the next prompts may share, then Scheduler.schedule → ScheduledStep
    reserve   Cache.Reserve its blocks (with a multi-step call's lookahead), or Cache.Free the preempted
    run       StepExecutor.run → a StepResult per step compute ran (a Forward, or each step of a ForwardSteps)
    update    each result's tokens appended, finished sequences released, outputs to their requests — one
              path whether compute ran one step or several

The engine (gateway/engine.py) calls `schedule`, then `run`, once an iteration. Tests inject faults here
only: a StepHook (--step-hook) is called as each stage begins and may wrap the compute stub.
"""

from collections.abc import Iterator
from contextlib import closing
from functools import partial
from typing import TYPE_CHECKING

import grpc
import structlog

from common.errors import from_rpc_error
from gateway.config import EngineConfig
from gateway.disagg import PrefillLane
from gateway.engine_view import EngineView
from gateway.executor import StepExecutor
from gateway.lease import Lease
from gateway.live_seqs import LiveSeqs
from gateway.outputs import Output, append_token
from gateway.pooled import pooled_rows, take_pooled
from gateway.recovery import PeerFault, calling
from gateway.sampling import token_logprobs
from gateway.scheduler import Scheduler
from gateway.sequence import Sequence
from gateway.step import ScheduledStep, StepResult
from gateway.step_faults import Faulty, StepFaults
from gateway.step_hook import load_hook
from gateway.step_pace import StepShape
from gateway.step_timer import StepTimer
from gateway.structured.matcher import prefetch
from protos import compute_pb2_grpc

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = structlog.get_logger()


class StepRunner:
    """Runs the engine's steps on one attached pool, from the engine thread."""

    def __init__(
        self,
        compute: compute_pb2_grpc.ComputeStub,
        scheduler: Scheduler,
        live: LiveSeqs,
        lease: Lease,
        view: EngineView,
        tokenizer: "PreTrainedTokenizerBase",
        config: EngineConfig,
        prefill: compute_pb2_grpc.ComputeStub | None = None,
    ) -> None:
        self._hook = hook = load_hook(config.step_hook) if config.step_hook else None
        self.scheduler, self.kv, self.live, self.lease = scheduler, scheduler.kv, live, lease
        self.executor = StepExecutor(hook.compute(compute) if hook else compute, self.kv, lease, config)
        self.prefill = PrefillLane(prefill, self.kv, lease, config) if prefill is not None else None
        self.view, self.tokenizer, self.decode_steps = view, tokenizer, config.decode_steps
        self.faults = StepFaults(live)
        self._eos: frozenset[int] = frozenset()

    def attach(self, epoch: str, eos_ids: frozenset[int]) -> None:
        """The pool compute has attached, and the model's EOS ids."""
        self.executor.attach(epoch, eos_ids)
        if self.prefill is not None:
            self.prefill.executor.attach(epoch, eos_ids)
        self._eos = eos_ids

    # schedule
    def schedule(self) -> ScheduledStep | None:
        """The next step, after the Lookup (a failed one leaves the prompts to start from 0). A sequence whose
        scheduling raised fails its request alone; if scheduling itself raises, every request it chose from
        fails instead."""
        seqs = self.scheduler.unlooked()
        if seqs:
            try:
                with calling("cache"):
                    self.kv.lookup(seqs, self.scheduler.running)
            except PeerFault as fault:
                log.warning("lookup_failed", error=fault.err.details())
        try:
            step = self.scheduler.schedule()
        except Exception as exc:  # noqa: BLE001
            self.live.fail_internal([*self.scheduler.running, *self.scheduler.waiting], exc)
            return None
        if step is not None:
            step.faulty += self._rows_raising("schedule", step.seqs)
            if step.faulty:
                self.faults.set_aside(step.faulty)
                step.seqs[:] = [seq for seq in step.seqs if self.live.holds(seq)]
        return step

    # one step
    def run(self, step: ScheduledStep, timer: StepTimer, news: bool) -> tuple[str, str] | None:
        """The step's blocks reserved (or the preempted freed), then run and updated; `news`: requests wait to
        be admitted (no multi-step call then). Returns the peer lost and why, which stops the engine's
        stepping until it is back; another failed call ends the step's sequences with its error, and any
        other exception with INTERNAL."""
        seqs = step.seqs or step.preempted
        if not seqs:
            return None
        try:
            with timer.phase("cache_rpc"):
                self.reserve(step, news)
            if not step.seqs:
                return None
            log.debug("step", chunks=[[s.request_id, s.index, s.chunk_len] for s in step.seqs])
            if not self.lease.held():  # the blocks may be another gateway's by now: compute must not write
                return "cache", "the session's lease lapsed"
            if self.prefill is None or not self.prefill.run(self, step, timer):  # gateway/disagg.py
                self.update_all(self.results(step, timer))
        except PeerFault as fault:
            if fault.lost:
                return fault.service, str(fault)
            self.live.fail(seqs, from_rpc_error(fault.err))
        except Exception as exc:  # noqa: BLE001 - one step's fault must not end the loop
            self.live.fail_internal(seqs, exc)
        return None

    # reserve
    def reserve(self, step: ScheduledStep, news: bool) -> None:
        """The reserve stage: frees the preempted, or reserves the step's blocks and sets its num_steps."""
        if step.preempted:
            computed = [s.num_computed for s in step.preempted]  # before the free drops them
            with calling("cache"):
                self.kv.free(step.preempted)
            log.info("preempted", seq_ids=[s.seq_id for s in step.preempted], computed=computed)
            return
        lookahead = self.scheduler.multi_steps(step, self.decode_steps, news) - 1
        step.num_steps = self.reserve_rows(step, lookahead) + 1

    def reserve_rows(self, step: ScheduledStep, lookahead: int) -> int:
        """The step's Reserve, with slots for up to `lookahead` more tokens per sequence; returns the
        lookahead reserved (0 if the blocks for it were short). One refused for want of blocks (the
        admission counted on a stale Lookup) undoes the step's admissions: those sequences wait again, and
        the step runs the others (the cache changed nothing: a Reserve is all or nothing). Any other
        failure is isolated."""
        try:
            self._stage("reserve", step.seqs)
            with calling("cache"):
                self.kv.reserve(step.seqs, lookahead)
            return lookahead
        except PeerFault as fault:
            if fault.lost:
                raise
            if fault.err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return self._short_of_blocks(step, lookahead, fault)
            error: Exception = fault
        except Exception as exc:  # noqa: BLE001 - isolated below
            error = exc
        log.warning("reserve_fault", seq_ids=[s.seq_id for s in step.seqs], error=str(error))
        results = self.faults.isolate(step.seqs, error, self._reserve_alone)
        reserved = {seq.seq_id for rows in results for seq in rows}
        step.seqs[:] = [seq for seq in step.seqs if seq.seq_id in reserved and self.live.holds(seq)]
        return 0

    def _reserve_alone(self, rows: list[Sequence]) -> list[Sequence]:
        self._stage("reserve", rows)
        with calling("cache"):
            self.kv.reserve(rows)
        return rows

    def _short_of_blocks(self, step: ScheduledStep, lookahead: int, fault: PeerFault) -> int:
        if lookahead:
            return self.reserve_rows(step, 0)
        new = [seq for seq in step.seqs if not self.kv.holds(seq)]
        if not new:
            raise fault
        log.warning("admission_undone", seq_ids=[s.seq_id for s in new], error=fault.err.details())
        self.scheduler.unadmit(new)
        step.seqs[:] = [seq for seq in step.seqs if self.kv.holds(seq)]
        if step.seqs:  # a failure from here on fails only them
            with calling("cache"):
                self.kv.reserve(step.seqs)
        return 0

    # run
    def update_all(self, results: Iterator[StepResult]) -> None:
        """The run stage's results, each updated as it comes; the outputs held while compute ran their rows on
        are handed over once the call is over."""
        held: list[tuple[Sequence, Output]] = []
        deferred: Faulty = []
        try:
            with closing(results) as results:
                for result in results:
                    held += self._update(result, deferred)
        finally:
            self.live.release([seq for seq, _ in held])
            for seq, output in held:
                seq.outbox.put(output)
            self.faults.set_aside(deferred)

    def results(self, step: ScheduledStep, timer: StepTimer) -> Iterator[StepResult]:
        """The step's results; if it fails without losing a peer, those of its rows' reruns without the
        cause."""
        try:
            self._stage("run", step.seqs)
            with closing(self.executor.run(step, timer)) as results:
                yield from results
            return
        except PeerFault as fault:
            if fault.lost:
                raise
            error: Exception = fault
        except Exception as exc:  # noqa: BLE001 - isolated below
            error = exc
        log.warning("step_fault", seq_ids=[s.seq_id for s in step.seqs], error=str(error))
        yield from self.faults.isolate(step.seqs, error, partial(self.rerun, step.kind))

    def rerun(self, kind: str, rows: list[Sequence]) -> StepResult | None:
        """The rows run again as a step of their own (a Forward). A row a multi-step call had advanced (its
        chunk computed by an earlier step of the call) gets its next decode token as its chunk."""
        for seq in rows:
            if seq.chunk_end <= seq.num_computed:
                seq.chunk_end = seq.num_tokens
        self._stage("run", rows)
        with closing(self.executor.run(ScheduledStep(rows, kind=kind), StepTimer())) as results:
            return next(results, None)

    # update
    def _update(self, result: StepResult, deferred: Faulty) -> list[tuple[Sequence, Output]]:
        """One step's result into its sequences: samples fork at their prompt's end, the sampled tokens are
        appended, finished sequences released, the outputs handed to their requests. A sequence that ended
        while compute runs its row on (a multi-step's stop string) ends the call and is returned, to be
        released once the call is over; a row that cannot be updated fails alone, once the call is over if
        compute runs it on. (No request waits for the room it frees: a multi-step call starts only when none
        waits, and a new one ends it.)"""
        faulty: Faulty = []
        shape = StepShape.of(result.seqs)
        with result.timer.phase("cache_rpc"):
            for seq in [seq for seq in result.seqs if seq.forks_now]:
                self.faults.row(faulty, seq, partial(self._fork, seq))
        pooling = pooled_rows(result.seqs)  # NOTE: before _advance moves the chunks on
        outputs = self._advance(result, faulty)
        outputs += take_pooled(result.seqs, pooling, result.reply, faulty)
        if faulty:
            outputs = self._fail_rows(faulty, outputs, result.running_on, deferred)
        self.view.account(outputs)
        ended = [(seq, output) for seq, output in outputs if output.finish_reason]
        held = [(seq, output) for seq, output in ended if seq.seq_id in result.running_on]
        if held:
            self.executor.end_call()
        # NOTE: blocks are back in the pool before the client hears that its request ended.
        self.live.release([seq for seq, output in ended if seq.seq_id not in result.running_on])
        for seq, output in outputs:
            if seq.seq_id not in result.running_on or not output.finish_reason:
                seq.outbox.put(output)
        seconds = result.timer.finish(result.kind)
        if self.scheduler.pace is not None and not result.reply.same_step:
            self.scheduler.pace.observe(shape, seconds)
        return held

    def _fork(self, seq: Sequence) -> None:
        """The samples of `seq`'s request fork from it."""
        with calling("cache"):
            self.live.fork(seq)

    def _advance(self, result: StepResult, faulty: Faulty) -> list[tuple[Sequence, Output]]:
        """The step's chunks are computed; each sequence that sampled gets its token, and its Output."""
        sampled = [seq for seq in result.seqs if seq.samples_now]
        for seq in result.seqs:
            seq.num_computed, seq.cached_prefix = seq.chunk_end, False
        outputs = []
        logprobs = token_logprobs(result.reply, sampled)
        for seq, token, token_logprob in zip(sampled, result.reply.token_ids, logprobs, strict=True):
            text = self.faults.row(faulty, seq, partial(self._append, seq, token))
            if text is None:
                continue
            per_token = None if token_logprob is None else [token_logprob]
            outputs.append((seq, Output([token], seq.finish_reason, seq.index, text, per_token)))
        ok = {id(seq) for seq, _ in outputs}
        prefetch([s.constraint for s in sampled if s.constraint and not s.finish_reason and id(s) in ok])
        return outputs

    def _fail_rows(
        self,
        faulty: Faulty,
        outputs: list[tuple[Sequence, Output]],
        running_on: frozenset[str],
        deferred: Faulty,
    ) -> list[tuple[Sequence, Output]]:
        """The update's faulty rows fail alone; returns the other requests' outputs. A row compute still runs
        on ends the call and goes to `deferred`: its request fails once compute writes its blocks no more."""
        later = [(seq, exc) for seq, exc in faulty if seq.seq_id in running_on]
        if later:
            self.executor.end_call()
            deferred += later
        for seq, _ in later:  # ended here: the call's later replies skip it (StepExecutor)
            seq.finish_reason = "abort"
        self.faults.set_aside([(seq, exc) for seq, exc in faulty if seq.seq_id not in running_on])
        doomed = {seq.group_id for seq, _ in deferred}
        return [
            (seq, output) for seq, output in outputs if self.live.holds(seq) and seq.group_id not in doomed
        ]

    def _append(self, seq: Sequence, token: int) -> str:
        self._stage("update", [seq])
        return append_token(seq, token, self._eos, self.tokenizer)

    # test hooks
    def _stage(self, name: str, seqs: list[Sequence]) -> None:
        if self._hook is not None:
            self._hook.stage(name, seqs)

    def _rows_raising(self, stage: str, seqs: list[Sequence]) -> Faulty:
        """The rows for which the hook raises as `stage` begins, with what it raised."""
        faulty: Faulty = []
        for seq in seqs if self._hook is not None else ():
            self.faults.row(faulty, seq, partial(self._hook.stage, stage, [seq]))
        return faulty
