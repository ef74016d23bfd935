"""The run stage of a gateway step: a ScheduledStep sent to compute, as one Forward or as a multi-step
(Compute.ForwardSteps) call, and a StepResult for each step compute ran. Each call has a deadline of a
step (gateway/step_deadline.py). A call that fails raises (PeerFault naming compute): the step runner
isolates its cause (gateway/step_faults.py)."""

import threading
import time
from collections.abc import Callable, Iterator

from common.server import request_metadata
from gateway import prompt_scores
from gateway.config import EngineConfig
from gateway.image_leases import IN_DOUBT, ImageLeases
from gateway.kv_view import KVView
from gateway.lease import Lease
from gateway.recovery import PeerFault, calling
from gateway.sequence import Sequence
from gateway.step import ScheduledStep, StepResult
from gateway.step_deadline import ReplyDeadline, StepDeadline, StepExpired
from gateway.step_request import forward_request, multi_step_request, row_limit, with_lookup
from gateway.step_timer import StepTimer
from protos import compute_pb2, compute_pb2_grpc


class StepExecutor:
    """Runs steps on compute's attached pool (`attach` after every handshake). One step at a time, from the
    engine thread; `end_call` may come from any thread."""

    def __init__(
        self,
        compute: compute_pb2_grpc.ComputeStub,
        kv: KVView,
        lease: Lease,
        config: EngineConfig,
        peer: str = "compute",
    ) -> None:
        # NOTE: every request names the lease's session epoch: compute runs it only while that session is
        # open at the cache (the pool's session fence), so a lapsed lease's step writes nothing.
        self._compute, self._kv, self._lease, self._peer = compute, kv, lease, peer
        self._deadline = StepDeadline(config.step_timeout_s, config.rpc_timeout_s)
        self._draft_tokens = config.draft_tokens
        self._epoch, self._eos = "", frozenset()
        # Set while a multi-step call runs: setting it ends the call after compute's current step.
        self._call_stop: threading.Event | None = None
        # The image store's leases around a step with images (gateway.image_leases; None: none taken).
        self.images: ImageLeases | None = None
        # Whether a multi-step call is to end after its first step already (a disaggregated step's decode
        # rounds end once the prefill compute is back: gateway/disagg.py).
        self.ends_now: Callable[[], bool] = lambda: False

    def attach(self, epoch: str, eos_ids: frozenset[int]) -> None:
        """The pool compute has attached, and the model's EOS ids."""
        self._epoch, self._eos = epoch, eos_ids

    @property
    def in_call(self) -> bool:
        """Whether a multi-step call runs."""
        return self._call_stop is not None

    def end_call(self) -> None:
        """A running multi-step call ends after compute's current step (news for the engine, or a row the
        gateway ended that compute runs on)."""
        call_stop = self._call_stop
        if call_stop is not None:
            call_stop.set()

    def run(self, step: ScheduledStep, timer: StepTimer) -> Iterator[StepResult]:
        """The step's results, each as compute returns it (PeerFault naming compute if a call fails)."""
        if step.num_steps > 1:
            yield from self._multi_step(step.seqs, step.num_steps, timer)
            return
        with timer.phase("compute_rpc"):
            reply = self._forward(step.seqs)
        timer.compute = reply
        yield StepResult(step.seqs, reply, timer, step.kind)

    def _forward(self, seqs: list[Sequence]) -> compute_pb2.ForwardResponse:
        """One Forward of the chunks of `seqs` (PeerFault naming compute if it fails)."""
        reply = self.forward_call(seqs)()
        self.took(seqs, reply)
        return reply

    def forward_call(self, seqs: list[Sequence]) -> Callable[[], compute_pb2.ForwardResponse]:
        """The Forward of the chunks of `seqs`, built now; the call that sends it (from any thread) returns
        compute's reply, or raises PeerFault naming this executor's peer."""
        tables = self._kv.step_tables(seqs)
        request = forward_request(seqs, tables, self._epoch, self._eos, self._lease.epoch)
        tokens, metadata = len(request.token_ids), request_metadata(seq.request_id for seq in seqs)
        leased = self.images.acquire(request, [seq.cache_salt for seq in seqs]) if self.images else []

        def send() -> compute_pb2.ForwardResponse:
            try:
                with calling(self._peer):
                    start = time.monotonic()
                    timeout = self._deadline.timeout(tokens)
                    reply = self._compute.Forward(request, timeout=timeout, metadata=metadata)
            except PeerFault as fault:
                if leased:
                    self.images.release(leased, ran=False, settled=fault.err.code() not in IN_DOUBT)
                raise
            if leased:
                self.images.release(leased, ran=True)
            self._deadline.observe(time.monotonic() - start, tokens)
            return reply

        return send

    @staticmethod
    def took(seqs: list[Sequence], reply: compute_pb2.ForwardResponse) -> None:
        """A Forward's reply kept by its rows (their prompt scores), on the engine thread."""
        prompt_scores.collect(seqs, reply)

    def _multi_step(self, seqs: list[Sequence], steps: int, timer: StepTimer) -> Iterator[StepResult]:
        """The decode step of `seqs` and up to steps - 1 more in one ForwardSteps call, a StepResult (and
        StepTimer) each."""
        limits = [row_limit(seq, steps, self._eos) for seq in seqs]
        tables = self._kv.step_tables(seqs)
        request = multi_step_request(seqs, tables, self._epoch, self._eos, limits, self._lease.epoch)
        with_lookup(request, seqs, self._draft_tokens)
        stop = self._call_stop = threading.Event()
        if self.ends_now():
            stop.set()
        step_s, deadline = self._deadline.timeout(len(seqs)), None
        try:
            with calling(self._peer):
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
                        return
                    deadline.replied(step_s)
                    self._deadline.observe(time.perf_counter() - timer.start, len(reply.rows))
                    timer.compute = reply
                    yield _step_result(seqs, reply, timer)
                    timer = StepTimer()
        except PeerFault as fault:
            if deadline is not None and deadline.expired:
                raise PeerFault("compute", StepExpired(step_s)) from fault
            raise
        finally:
            if deadline is not None:
                deadline.close()
            stop.set()
            self._call_stop = None


def _step_result(seqs: list[Sequence], reply: compute_pb2.ForwardResponse, timer: StepTimer) -> StepResult:
    """One reply of a multi-step call (rows: indices into the call's `seqs`). Rows the gateway ended while
    compute runs them on (a stop string) skip their tokens; the others' chunk is the token after their
    computed ones, and those compute runs on after this reply (ForwardResponse.running) are the result's
    running_on."""
    live = [seqs[row] for row in reply.rows]
    keep = [seq.finish_reason is None for seq in live]
    # NOTE: a compute that does not say which rows it runs on is taken to run on every one (their blocks
    # are then released once the call is over).
    running = reply.running or [True] * len(reply.rows)
    rows = [row for row, kept in zip(reply.rows, keep, strict=True) if kept]
    for row in rows:
        seqs[row].chunk_end = seqs[row].num_computed + 1
    running_on = frozenset(
        seqs[row].seq_id for row, kept, going in zip(reply.rows, keep, running, strict=True) if kept and going
    )
    return StepResult(
        [seqs[row] for row in rows], select_rows(reply, live, keep), timer, "decode", running_on
    )


def _messages(first: compute_pb2.StepsRequest, stop: threading.Event) -> Iterator[compute_pb2.StepsRequest]:
    """A multi-step call's requests: the first step, then the half-close once `stop` is set (compute then
    stops after the step it runs)."""
    yield first
    stop.wait()


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
