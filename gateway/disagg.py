"""Disaggregated prefill and decode on one host (docs/scaling.md): a prefill compute beside the decode
compute, both attached to the cache's one pool. A step's long prompt chunks go to the prefill compute as one
Forward, sent from a thread of its own, while the engine thread runs the step's decodes on the decode
compute, round after round, until that Forward is back: a burst of long prompts does not stretch the running
streams' token gaps. Nothing moves at the hand-over: the prefill compute writes the prompt's K/V into the
shared pool, where the decode compute reads it in place, and every step carries the rest (compute keeps no
state between steps).

Routing: a row goes to the prefill compute when it computes more than one token and at least `threshold` of
its tokens are still to compute (a prompt, or a preempted sequence computed again); a shorter one stays with
the decodes, whose step it barely lengthens, and pays no round trip of its own.

A prefill compute that is gone (nothing answers, or a restarted process without the pool) detaches the lane:
the rows of its call run again on the decode compute, which runs whole steps, prompts and decodes, until the
lane attaches the prefill compute again (retried with the recovery's delays). One that does not answer within
the step deadline may only be stalled, and write later into its call's blocks: it stops the engine as a lost
compute does (gateway/engine.py).
"""

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import TYPE_CHECKING

import structlog

from gateway.config import RETRY_TIMEOUT_S, EngineConfig
from gateway.executor import StepExecutor
from gateway.kv_view import KVView
from gateway.lease import Lease
from gateway.recovery import PeerFault, PeerRecovery, calling
from gateway.sequence import Sequence
from gateway.step import ScheduledStep, StepResult
from gateway.step_timer import StepTimer
from protos import common_pb2, compute_pb2, compute_pb2_grpc

if TYPE_CHECKING:
    from gateway.step_runner import StepRunner

log = structlog.get_logger()

# What a prefill compute must share with the decode compute to write K/V the decode compute reads.
_SAME = ("model", "num_layers", "num_kv_heads", "head_dim", "dtype", "kv_dtype", "kv_scales_id", "vocab_size")


def routes_to_prefill(seq: Sequence, threshold: int) -> bool:
    """Whether the row's scheduled chunk runs on the prefill compute: it computes more than one token and
    the sequence has at least `threshold` tokens to compute from the chunk's start."""
    return seq.chunk_len > 1 and seq.num_tokens - seq.num_computed >= threshold


def split(seqs: list[Sequence], threshold: int) -> tuple[list[Sequence], list[Sequence]]:
    """The step's rows for the prefill compute, and those for the decode compute, each in step order."""
    prefill = [seq for seq in seqs if routes_to_prefill(seq, threshold)]
    chosen = {id(seq) for seq in prefill}
    return prefill, [seq for seq in seqs if id(seq) not in chosen]


def prefill_info(compute: compute_pb2_grpc.ComputeStub, timeout: float, wait: bool) -> compute_pb2.ModelInfo:
    """The prefill compute's model info (PeerFault naming "prefill" if the call fails): asked first, so
    that a handshake waiting for a restarting prefill compute attaches nothing meanwhile."""
    with calling("prefill"):
        return compute.GetModelInfo(compute_pb2.GetModelInfoRequest(), wait_for_ready=wait, timeout=timeout)


def attach_prefill(
    compute: compute_pb2_grpc.ComputeStub,
    own: compute_pb2.ModelInfo,
    info: compute_pb2.ModelInfo,
    handle: common_pb2.PoolHandle,
    timeout: float,
) -> None:
    """The prefill compute, whose model info is `own`, attached to the decode compute's pool `handle` after
    checking it serves the same model as `info` in the same layout (PeerFault naming "prefill" if the call
    fails; ValueError if not)."""
    differ = [name for name in _SAME if getattr(own, name) != getattr(info, name)]
    if differ or own.tensor_parallel_size > 1:
        raise ValueError(
            f"the prefill compute serves another model or layout than the decode compute ({', '.join(differ)}"
            f" differ, tensor_parallel_size {own.tensor_parallel_size}): start both with the same flags"
        )
    with calling("prefill"):
        compute.AttachPool(handle, timeout=timeout)


class PrefillLane:
    """The prefill compute's calls, one at a time, each sent from the lane's thread. A call's request is built
    on the engine thread (it reads the KV view and the sequences), and its reply taken back there."""

    def __init__(
        self,
        compute: compute_pb2_grpc.ComputeStub,
        kv: KVView,
        lease: Lease,
        config: EngineConfig,
    ) -> None:
        self.threshold = config.prefill_threshold
        self.executor = StepExecutor(compute, kv, lease, config, peer="prefill")
        self._compute = compute
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="prefill")
        # Whether the prefill compute is attached to the pool; while not, attached again when `_retry` says.
        self.attached = False
        self._retry = PeerRecovery(0.0, {"prefill": config.prefill_target})

    def attached_to(self, attached: bool, handle: common_pb2.PoolHandle) -> None:
        """After the engine's handshake: the prefill compute attached to the pool `handle`, or gone."""
        if not attached:
            self.detach("gone at the handshake")
            return
        if self._retry.active:
            log.info("prefill_attached", epoch=handle.epoch)
        self.attached = True
        self._retry.recovered()

    def detach(self, why: str) -> None:
        """The prefill compute is gone: the decode compute runs whole steps until it is attached again."""
        if self.attached or not self._retry.active:
            log.warning("prefill_detached", error=why)
        self.attached = False
        self._retry.lost("prefill")

    def retry_in(self) -> float | None:
        """Seconds until the detached lane's next attempt to attach (0: now); None while attached."""
        return None if self.attached else self._retry.retry_in()

    def reattach(self, info: compute_pb2.ModelInfo, handle: common_pb2.PoolHandle) -> None:
        """One attempt to attach the prefill compute again, at most RETRY_TIMEOUT_S; a failed one is retried
        after the recovery's next delay."""
        try:
            own = prefill_info(self._compute, RETRY_TIMEOUT_S, wait=False)
            attach_prefill(self._compute, own, info, handle, RETRY_TIMEOUT_S)
        except (PeerFault, ValueError) as error:
            log.debug("prefill_attach_failed", error=str(error))
            self._retry.failed("prefill")
        else:
            self.attached_to(True, handle)

    def run(self, runner: "StepRunner", step: ScheduledStep, timer: StepTimer) -> bool:
        """Runs the step's run and update stages split between the computes, if the prefill compute is
        attached and a row routes to it; returns whether it did (if not, the decode compute runs the whole
        step)."""
        if not self.attached:
            return False
        prefill, decode = split(step.seqs, self.threshold)
        if not prefill:
            return False
        self._run_split(runner, ScheduledStep(prefill), ScheduledStep(decode, kind="decode"), timer)
        return True

    def _run_split(
        self, runner: "StepRunner", prefill: ScheduledStep, decode: ScheduledStep, timer: StepTimer
    ) -> None:
        """The chunks of `prefill` on the prefill compute, while the engine thread runs the rows of `decode`
        on the decode compute, then more decode rounds of its rows until the prefill compute is back (a
        multi-step call ends after its current step then); then the prefill's result is updated. The
        prefill's call is over before this returns, whatever happened: compute writes none of its blocks
        after that."""
        send, sent = self.executor.forward_call(prefill.seqs), StepTimer()
        future = self._thread.submit(_timed, send, sent)
        future.add_done_callback(lambda _: runner.executor.end_call())
        runner.executor.ends_now, rounds = future.done, 0
        try:
            if decode.seqs:
                runner.update_all(runner.results(decode, timer))
            rounds = self._decode_rounds(runner, decode.seqs, future)
        finally:
            runner.executor.ends_now = _never
            wait([future])
            ms = round((time.perf_counter() - sent.start) * 1e3, 2)
            chunks = [[s.request_id, s.chunk_len] for s in prefill.seqs]
            log.debug("split_step", prefill=chunks, decodes=len(decode.seqs), rounds=rounds, ms=ms)
        runner.update_all(self._results(runner, prefill, future, sent))

    @staticmethod
    def _decode_rounds(runner: "StepRunner", rows: list[Sequence], future: Future) -> int:
        """Decode steps of those of `rows` that still decode, each reserved and run as a step of its own,
        until `future` is done; none once their blocks would reach into the watermark (the next step may
        preempt then). Returns how many were run (a multi-step call counts once)."""
        kv, scheduler, rounds = runner.kv, runner.scheduler, 0
        while not future.done():
            rows = [seq for seq in runner.faults.pending(rows) if seq.num_tokens - seq.num_computed == 1]
            needed = sum(kv.blocks_needed(seq, seq.num_tokens) for seq in rows)
            if not rows or needed > kv.available_blocks - scheduler.watermark:
                return rounds
            for seq in rows:
                seq.chunk_end = seq.num_tokens
            step = ScheduledStep(rows, kind="decode")
            lookahead = scheduler.multi_steps(step, runner.decode_steps, news=False, waiting=False) - 1
            step.num_steps = runner.reserve_rows(step, lookahead) + 1
            if not step.seqs:
                return rounds
            runner.update_all(runner.results(step, StepTimer()))
            rounds += 1
        return rounds

    def _results(
        self, runner: "StepRunner", step: ScheduledStep, future: Future, timer: StepTimer
    ) -> Iterator[StepResult]:
        """The prefill's result (`timer` started as it was sent); if the prefill compute is gone, its rows'
        rerun on the decode compute; if its call failed without losing the prefill compute, those of its rows'
        reruns (on the decode compute) without the cause."""
        try:
            reply = future.result()
        except PeerFault as fault:
            if fault.gone:  # (a gone peer is a lost one)
                self.detach(str(fault))
                rows = runner.faults.pending(step.seqs)
                rerun = runner.rerun(step.kind, rows) if rows else None
                if rerun is not None:
                    yield rerun
                return
            if fault.lost:
                raise
            error: Exception = fault
        else:
            self.executor.took(step.seqs, reply)
            timer.compute = reply
            yield StepResult(step.seqs, reply, timer, step.kind)
            return
        log.warning("prefill_fault", seq_ids=[s.seq_id for s in step.seqs], error=str(error))
        yield from runner.faults.isolate(step.seqs, error, partial(runner.rerun, step.kind))


def _never() -> bool:
    return False


def _timed(send: Callable[[], compute_pb2.ForwardResponse], timer: StepTimer) -> compute_pb2.ForwardResponse:
    """The prefill's call, as its step's compute_rpc phase (the lane's thread holds the timer meanwhile)."""
    with timer.phase("compute_rpc"):
        return send()
