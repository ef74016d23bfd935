"""The engine's step: one Cache.Reserve (or Free of the preempted), one Compute.Forward, then the sampled
tokens appended, finished sequences released and outputs handed to their requests."""

import grpc
import structlog

from common.errors import PagedServeError, from_rpc_error
from gateway.config import FAIL_STEP_ENV
from gateway.forward import forward_rows
from gateway.outputs import advance
from gateway.recovery import PeerFault, calling
from gateway.scheduler import ScheduledStep
from gateway.sequence import Sequence
from gateway.step_timer import StepTimer
from protos import compute_pb2

log = structlog.get_logger()


class Stepping:
    """The step half of gateway.engine.Engine, which owns the state it uses (kv, scheduler, lease, the
    compute stub and steps, model_info, handle, view, _by_id) and the request lifecycle (_release,
    _fail, _fail_internal, _lose)."""

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
            self._reserve(step)
        if not step.seqs:
            return
        chunks = [[s.request_id, s.index, s.chunk_end - s.num_computed] for s in step.seqs]
        log.debug("step", chunks=chunks)
        if self._fail_step in {seq.request_id for seq in step.seqs}:
            raise RuntimeError(f"injected step fault ({FAIL_STEP_ENV})")
        if not self.lease.held():  # the blocks may be another gateway's by now: compute must not write them
            self._lose("cache")
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

    def _reserve(self, step: ScheduledStep) -> None:
        """The step's Reserve. One refused for want of blocks (the admission counted on a stale Lookup)
        undoes the step's admissions: those sequences wait again, and the step runs the others. The cache
        changed nothing (a Reserve is all or nothing), so no block is leaked."""
        try:
            with calling("cache"):
                self.kv.reserve(step.seqs)
        except PeerFault as fault:
            new = [seq for seq in step.seqs if not self.kv.holds(seq)]
            if fault.lost or fault.err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or not new:
                raise
            log.warning("admission_undone", seq_ids=[s.seq_id for s in new], error=fault.err.details())
            self._undo_admissions(step, new)

    def _undo_admissions(self, step: ScheduledStep, new: list[Sequence]) -> None:
        """The step's new sequences wait again; the others are reserved alone (the step list shrinks in
        place: a failure from here on fails only them)."""
        self.scheduler.unadmit(new)
        step.seqs[:] = [seq for seq in step.seqs if self.kv.holds(seq)]
        if step.seqs:
            with calling("cache"):
                self.kv.reserve(step.seqs)

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
