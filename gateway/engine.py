"""The serving loop: start-up handshake, then one step = one Cache.Reserve + one Compute.Forward."""

import os
import threading
import time

import structlog
from transformers import PreTrainedTokenizerBase

from common.errors import Cancelled, PagedServeError, Unavailable
from common.server import channel
from gateway.config import FAIL_STEP_ENV, HANDSHAKE_TIMEOUT_S, RETRY_TIMEOUT_S, EngineConfig
from gateway.engine_view import EngineView
from gateway.forward import ComputeSteps
from gateway.handshake import handshake
from gateway.kv_view import KVView
from gateway.lease import Lease
from gateway.outputs import by_request, tell
from gateway.recovery import PeerFault, PeerRecovery, calling
from gateway.scheduler import ScheduledStep, Scheduler
from gateway.sequence import Sequence
from gateway.step_timer import StepTimer
from gateway.stepping import Stepping
from protos import cache_pb2_grpc, common_pb2, compute_pb2, compute_pb2_grpc

log = structlog.get_logger()


class Engine(Stepping):
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._cache = cache_pb2_grpc.CacheStub(channel(config.cache_target, config.internal_credentials))
        self._compute = compute_pb2_grpc.ComputeStub(
            channel(config.compute_target, config.internal_credentials)
        )
        self._cond = threading.Condition()
        self._intake: list[Sequence] = []
        self._aborts: set[str] = set()
        self._stopped = False
        self._by_id: dict[str, Sequence] = {}
        # Set while a ForwardSteps call runs: setting it ends the call after compute's current step.
        self._steps_stop: threading.Event | None = None
        self.model_info: compute_pb2.ModelInfo | None = None
        self.handle: common_pb2.PoolHandle | None = None
        self.kv: KVView | None = None
        self.scheduler: Scheduler | None = None
        self.view = EngineView()  # for the dashboard
        targets = {"cache": config.cache_target, "compute": config.compute_target}
        self.recovery = PeerRecovery(config.peer_restart_grace_s, targets)
        self._lost: set[str] = set()
        self._attached_at = 0.0
        self._steps = ComputeSteps(config.step_timeout_s, config.rpc_timeout_s)
        # Set when the loop died: every request is refused with it.
        self.dead: Unavailable | None = None
        self._fail_step = os.environ.get(FAIL_STEP_ENV) or None
        # NOTE: a session the cache service dropped (lapsed, or it restarted) took the tables with it.
        self.lease = Lease(self._cache, config.session_ttl_s, self.session_lost, config.rpc_timeout_s)

    # start-up
    def handshake(self, timeout: float = HANDSHAKE_TIMEOUT_S, wait: bool = True) -> None:
        """gateway.handshake.handshake, then the engine steps on that pool (PeerFault if a call fails).
        Re-runnable: the tables the cache held are freed (same pool) or forgotten (new epoch), the KV view
        starts afresh, the sequences keep their tokens for recompute, in a new session."""
        info, handle = handshake(self._cache, self._compute, self.config.block_size, timeout, wait)
        same_pool = self.handle is not None and self.handle.epoch == handle.epoch
        self.model_info, self.handle = info, handle
        self._attach(handle.shape[2], same_pool)
        with calling("cache"):
            self.lease.open()
        self._attached_at = time.monotonic()
        log.info(
            "attached", model=info.model, num_blocks=handle.shape[2], epoch=handle.epoch, again=same_pool
        )

    def _attach(self, num_blocks: int, same_pool: bool) -> None:
        if self.kv is None:  # the first handshake
            self.kv = KVView(
                self._cache, self.config.block_size, num_blocks, self.config.rpc_timeout_s, self.lease
            )
            config = self.config
            self.scheduler = Scheduler(
                self.kv, config.max_batched_tokens, config.max_seqs, config.prefill_tokens_with_decodes
            )
            return
        self.kv.reattach([seq for seq in self._by_id.values() if self.kv.holds(seq)], num_blocks, same_pool)

    def attached_epoch(self) -> str | None:
        """The epoch of the pool the engine steps on; None while a peer is lost or the loop is dead."""
        if self.handle is None or self.recovery.active or self.dead is not None:
            return None
        return self.handle.epoch

    @property
    def max_len(self) -> int:
        """Longest sequence servable: the model's limit, or the whole pool if that is smaller."""
        return min(self.model_info.max_model_len, self.kv.num_blocks * self.config.block_size)

    # requests
    def submit(self, seq: Sequence) -> None:
        """Queues the sequence; Unavailable while the loop is dead or a peer is lost past the grace."""
        with self._cond:
            if self.dead is not None:
                raise Unavailable(str(self.dead))
            if self.recovery.expired:
                raise self.recovery.error()
            self._intake.append(seq)
            self._cond.notify()
            self._end_steps()

    def _end_steps(self) -> None:
        """News for the loop: a running ForwardSteps call ends after its current step, so the loop sees it."""
        steps_stop = self._steps_stop
        if steps_stop is not None:
            steps_stop.set()

    def queued(self) -> int:
        """Requests waiting for a step: submitted, or in the scheduler's queue (read without a lock)."""
        return len(self._intake) + (len(self.scheduler.waiting) if self.scheduler else 0)

    def abort(self, seq_id: str) -> None:
        with self._cond:
            self._aborts.add(seq_id)
            self._cond.notify()
            self._end_steps()

    def peer_restarted(self, service: str, seen_at: float) -> None:
        """From the health watcher: `service` restarted (or serves another pool) after `seen_at`
        (time.monotonic()); the engine attaches again unless it did since."""
        with self._cond:
            if self._attached_at >= seen_at:
                return
            self._lost.add(service)
            self._cond.notify()
            self._end_steps()

    def session_lost(self) -> None:
        """From the lease: recovered like a lost cache."""
        self.peer_restarted("cache", time.monotonic())

    def stop(self) -> None:
        """Ends the loop after its step; pending requests get UNAVAILABLE now (no RPC thread outlives it);
        the session is closed (the cache service frees what it still holds)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            self._end_steps()
            pending = [*self._intake, *list(self._by_id.values())]
        tell(pending, Unavailable("the gateway is shutting down; retry on another replica or later"))
        self.lease.close()

    # loop
    def run(self) -> None:
        """The loop; if it cannot go on, `dead` is set (health turns NOT_SERVING) and every request fails."""
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - a dead loop must fail its requests, not hang them
            log.exception("engine_loop_failed")
            with self._cond:
                self.dead = Unavailable(
                    f"the gateway's engine stopped ({type(exc).__name__}: {exc}): restart it"
                )
                pending = [*self._intake, *list(self._by_id.values())]
            tell(pending, self.dead)

    def _loop(self) -> None:
        blocked = False
        while True:
            self.view.publish(self.scheduler, self.kv)
            with self._cond:
                # NOTE: work that cannot be scheduled (none should exist) waits for news instead of spinning.
                runnable = self.scheduler.has_work() and not blocked and not self.recovery.active
                timeout = self.recovery.retry_in() if self.recovery.active else None
                while not (self._stopped or self._intake or self._aborts or runnable or self._lost):
                    if not self._cond.wait(timeout) and timeout is not None:
                        break
                if self._stopped:
                    return
                intake, self._intake = self._intake, []
                aborts, self._aborts = self._aborts, set()
                lost, self._lost = self._lost, set()
            for service in lost:
                self._lose(service)
            timer = StepTimer()
            with timer.phase("schedule"):
                for seq in intake:
                    self._by_id[seq.seq_id] = seq
                    self.scheduler.add(seq)
                self._abort_now(aborts)
                if self.recovery.active:
                    self._recover()
                    continue
                step = self._schedule()
            blocked = step is None
            if step is not None:
                self._run_step(step, timer)

    def _schedule(self) -> ScheduledStep | None:
        """The next step; if scheduling raises, the requests it chose from fail (INTERNAL) instead."""
        self._look_up_prefixes()
        try:
            return self.scheduler.schedule()
        except Exception as exc:  # noqa: BLE001
            self._fail_internal([*self.scheduler.running, *self.scheduler.waiting], exc)
            return None

    def _look_up_prefixes(self) -> None:
        """The waiting sequences next in line learn the prefix the cache holds of them (once each), so their
        first step computes only the rest; a failed Lookup leaves them to start from 0."""
        seqs = self.scheduler.unlooked()
        if seqs:
            try:
                with calling("cache"):
                    self.kv.lookup(seqs, self.scheduler.running)
            except PeerFault as fault:
                log.warning("lookup_failed", error=fault.err.details())

    # recovery
    def _lose(self, service: str) -> None:
        """Stops stepping; running sequences wait again, to be recomputed after the next handshake."""
        if not self.recovery.active:
            log.warning("peer_lost", peer=service, running=len(self.scheduler.running))
        self.recovery.lost(service)
        self.scheduler.requeue_running()

    def _recover(self) -> None:
        """One handshake attempt when due; past the grace, the requests fail (and new ones are refused)."""
        if self.recovery.retry_in() == 0:
            try:
                self.handshake(timeout=RETRY_TIMEOUT_S, wait=False)
            except PeerFault as fault:
                self.recovery.failed(fault.service)
            else:
                log.info("peer_recovered", peer=self.recovery.service, waiting=len(self.scheduler.waiting))
                with self._cond:
                    self.recovery.recovered()
                return
        with self._cond:
            error = self.recovery.expire()
        if error is not None:
            log.error("peer_unavailable", peer=self.recovery.service, error=str(error))
            seqs = list(self._by_id.values())
            # NOTE: a lost cache holds nothing to free; a lost compute leaves the tables in a live cache.
            self._release(seqs, free=self.recovery.service != "cache")
            tell(seqs, error)

    def _abort_now(self, group_ids: set[str]) -> None:
        seqs = [seq for seq in self._by_id.values() if seq.group_id in group_ids] if group_ids else []
        if seqs:
            self._release(seqs)
            log.info("aborted", seq_ids=[s.seq_id for s in seqs])
        # NOTE: wakes the RPC thread still waiting for the request's outputs, so that it ends too.
        tell(seqs, Cancelled("the request was cancelled or its deadline passed"))

    def _release(self, seqs: list[Sequence], free: bool = True) -> None:
        """Takes ended sequences out; `free`: their blocks are freed in the cache, else only forgotten."""
        for seq in seqs:
            self.scheduler.remove(seq)
            del self._by_id[seq.seq_id]
        if free:
            self.kv.release(seqs)
        else:
            self.kv.forget([seq for seq in seqs if self.kv.holds(seq)])

    def _fail(self, seqs: list[Sequence], error: PagedServeError) -> None:
        seqs = [seq for seq in seqs if seq.seq_id in self._by_id]
        log.error("step_failed", seq_ids=[s.seq_id for s in seqs], code=error.code.name, error=str(error))
        self._release(seqs)
        tell(seqs, error)

    def _fail_internal(self, seqs: list[Sequence], exc: Exception) -> None:
        """A fault of the gateway's own code in one step: its requests fail with INTERNAL, naming them."""
        log.exception("step_fault", seq_ids=[s.seq_id for s in seqs])
        seqs = [seq for seq in seqs if seq.seq_id in self._by_id]
        for request_id, group in by_request(seqs).items():
            error = PagedServeError(f"{type(exc).__name__}: {exc} (request {request_id})")
            self._release(group)
            tell(group, error)
