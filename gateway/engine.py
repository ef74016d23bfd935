"""The serving loop: the start-up handshake, then steps — each scheduled and run by gateway/step_runner.py
(schedule → reserve → run → update, the stages meeting through the objects of gateway/step.py) — and the
recovery of a lost peer."""

import time
from typing import TYPE_CHECKING

import structlog

from common.errors import Unavailable
from common.server import channel
from gateway.config import HANDSHAKE_TIMEOUT_S, RETRY_TIMEOUT_S, EngineConfig
from gateway.disagg import attach_prefill, prefill_info
from gateway.engine_view import EngineView
from gateway.handshake import handshake
from gateway.image_leases import ImageLeases
from gateway.inbox import Inbox
from gateway.kv_view import KVView
from gateway.lease import Lease
from gateway.live_seqs import LiveSeqs
from gateway.outputs import tell
from gateway.recovery import RECONNECT_OPTIONS, PeerFault, PeerRecovery, calling
from gateway.scheduler import Scheduler
from gateway.sequence import Sequence
from gateway.step_pace import StepPace
from gateway.step_runner import StepRunner
from gateway.step_timer import StepTimer
from gateway.vision import EncoderBudget
from protos import cache_pb2_grpc, common_pb2, compute_pb2, compute_pb2_grpc

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = structlog.get_logger()
# The peers whose loss leaves the cache's pool and tables: the compute, and a prefill compute beside it.
COMPUTES = ("compute", "prefill")


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: "PreTrainedTokenizerBase") -> None:
        self.config = config
        self.tokenizer = tokenizer
        credentials = config.internal_credentials
        self._cache = cache_pb2_grpc.CacheStub(channel(config.cache_target, credentials, RECONNECT_OPTIONS))
        self._compute = compute_pb2_grpc.ComputeStub(
            channel(config.compute_target, credentials, RECONNECT_OPTIONS)
        )
        self._prefill = None
        if config.prefill_target:
            self._prefill = compute_pb2_grpc.ComputeStub(
                channel(config.prefill_target, credentials, RECONNECT_OPTIONS)
            )
        self.inbox = Inbox()
        self.model_info: compute_pb2.ModelInfo | None = None
        self.handle: common_pb2.PoolHandle | None = None
        self.kv: KVView | None = None
        self.scheduler: Scheduler | None = None
        self.runner: StepRunner | None = None
        self.live: LiveSeqs | None = None
        self.view = EngineView()  # for the dashboard
        targets = {"cache": config.cache_target, "compute": config.compute_target}
        if config.prefill_target:
            targets["prefill"] = config.prefill_target
        self.recovery = PeerRecovery(config.peer_restart_grace_s, targets)
        self._attached_at = 0.0
        # Set when the loop died: every request is refused with it.
        self.dead: Unavailable | None = None
        # Whether the tables the cache holds outlive the peer lost now: only compute was lost since the last
        # attach (the cache kept its pool, the session its tables), so running sequences go on from them.
        self._keep_tables = False
        # NOTE: a session the cache service dropped (lapsed, or it restarted) took the tables with it.
        self.lease = Lease(self._cache, config.session_ttl_s, self.session_lost, config.rpc_timeout_s)

    # start-up
    def handshake(self, timeout: float = HANDSHAKE_TIMEOUT_S, wait: bool = True) -> None:
        """gateway.handshake.handshake, then the engine steps on that pool (PeerFault if a call fails).
        Re-runnable. After a lost compute whose pool the cache kept (same epoch, the session still held),
        the tables, the session and the running sequences' progress stay: they go on from the K/V of their
        completed steps and compute again only the step that was in flight. Otherwise the tables the cache
        held are freed (same pool) or forgotten (new epoch), the KV view starts afresh and the sequences keep
        their tokens for recompute, in a new session."""
        prefill = self._prefill_info(timeout, wait)
        info, handle = handshake(self._cache, self._compute, self.config.block_size, timeout, wait)
        if prefill is not None:
            attach_prefill(self._prefill, prefill, info, handle, timeout)
        same_pool = self.handle is not None and self.handle.epoch == handle.epoch
        kept = same_pool and self._keep_tables and self.lease.held()
        self.model_info, self.handle = info, handle
        if not kept:
            self._attach(handle.shape[2], same_pool, tuple(g.window for g in handle.kv_groups) or (0,))
        self.runner.attach(handle.epoch, frozenset(info.eos_token_ids))
        if self.runner.prefill is not None:
            self.runner.prefill.attached_to(prefill is not None, handle)
        self.runner.executor.images.attach(info, handle)
        if not kept:
            with calling("cache"):
                self.lease.open()
        self._keep_tables = False
        self._attached_at = time.monotonic()
        kept_running = len(self.scheduler.running) if kept else 0
        log.info("attached", model=info.model, num_blocks=handle.shape[2], epoch=handle.epoch,
                 again=same_pool, kept_running=kept_running)  # fmt: skip

    def _prefill_info(self, timeout: float, wait: bool) -> compute_pb2.ModelInfo | None:
        """The prefill compute's model info, asked first (see prefill_info); None when, in a recovery, it is
        gone: the engine attaches the others and steps without it (gateway/disagg.py)."""
        if self._prefill is None:
            return None
        try:
            return prefill_info(self._prefill, timeout, wait)
        except PeerFault as fault:
            if wait or not fault.gone:
                raise
            return None

    def _attach(self, num_blocks: int, same_pool: bool, windows: tuple[int, ...]) -> None:
        if self.kv is None:  # the first handshake
            config = self.config
            self.kv = KVView(
                self._cache, config.block_size, num_blocks, config.rpc_timeout_s, self.lease, windows
            )
            pace = StepPace(config.decode_step_target_ms / 1e3) if config.decode_step_target_ms else None
            sizing = (config.prefill_tokens_with_decodes, pace, config.pace_streams)
            self.scheduler = Scheduler(self.kv, config.max_batched_tokens, config.max_seqs, *sizing)
            self.scheduler.encoder = EncoderBudget(config.encoder_budget)
            self.live = LiveSeqs(self.scheduler, self.kv)
            self.runner = StepRunner(
                self._compute,
                self.scheduler,
                self.live,
                self.lease,
                self.view,
                self.tokenizer,
                config,
                self._prefill,
            )
            self.inbox.interrupt = self.runner.executor.end_call
            images = ImageLeases(self._cache, self.lease, config.rpc_timeout_s)
            self.runner.executor.images = images
            if self.runner.prefill is not None:
                self.runner.prefill.executor.images = images
            return
        self.scheduler.requeue_running()
        held = [seq for seq in self.live.all() if self.kv.holds(seq)]
        self.kv.reattach(held, num_blocks, same_pool, windows)

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
        with self.inbox.lock:
            if self.dead is not None:
                raise Unavailable(str(self.dead))
            if self.recovery.expired:
                raise self.recovery.error()
            self.inbox.intake.append(seq)
            self.inbox.posted()

    def queued(self) -> int:
        """Requests waiting for a step: submitted, or in the scheduler's queue (read without a lock)."""
        return len(self.inbox.intake) + (len(self.scheduler.waiting) if self.scheduler else 0)

    def abort(self, seq_id: str) -> None:
        with self.inbox.lock:
            self.inbox.aborts.add(seq_id)
            self.inbox.posted()

    def peer_restarted(self, service: str, seen_at: float) -> None:
        """From the health watcher: `service` restarted (or serves another pool) after `seen_at`
        (time.monotonic()); the engine attaches again unless it did since."""
        with self.inbox.lock:
            if self._attached_at < seen_at:
                self.inbox.lose(service, seen_at)

    def session_lost(self) -> None:
        """From the lease: recovered like a lost cache."""
        self.peer_restarted("cache", time.monotonic())

    def stop(self) -> None:
        """Ends the loop after its step; pending requests get UNAVAILABLE now (no RPC thread outlives it);
        the session is closed (the cache service frees what it still holds)."""
        with self.inbox.lock:
            self.inbox.stopped = True
            self.inbox.posted()
            pending = self._pending()
        tell(pending, Unavailable("the gateway is shutting down; retry on another replica or later"))
        self.lease.close()

    # loop
    def run(self) -> None:
        """The loop; if it cannot go on, `dead` is set (health turns NOT_SERVING) and every request fails."""
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - a dead loop must fail its requests, not hang them
            log.exception("engine_loop_failed")
            with self.inbox.lock:
                self.dead = Unavailable(
                    f"the gateway's engine stopped ({type(exc).__name__}: {exc}): restart it"
                )
                pending = self._pending()
            tell(pending, self.dead)

    def _pending(self) -> list[Sequence]:
        return [*self.inbox.intake, *(self.live.all() if self.live else [])]

    def _loop(self) -> None:
        blocked = False
        while True:
            self.view.publish(self.scheduler, self.kv)
            # NOTE: work that cannot be scheduled (none should exist) waits for news instead of spinning.
            runnable = self.scheduler.has_work() and not blocked and not self.recovery.active
            lane = self.runner.prefill
            waits = [self.recovery.retry_in()] if self.recovery.active else []
            if lane is not None and not lane.attached:
                waits.append(lane.retry_in())
            news = self.inbox.take(runnable, min(waits, default=None), self._attached_at)
            if news is None:
                return
            intake, aborts, lost = news
            for service in lost:
                if service == "prefill" and lane is not None:
                    lane.detach("its health check saw it restart")
                else:
                    self._lose(service, "its health check saw it restart")
            timer = StepTimer()
            with timer.phase("schedule"):
                self.live.add(intake)
                for seq in intake:
                    self.scheduler.add(seq)
                self.live.abort(aborts)
                if self.recovery.active:
                    self._recover()
                    continue
                if lane is not None and lane.retry_in() == 0:
                    lane.reattach(self.model_info, self.handle)
                step = self.runner.schedule()
            blocked = step is None
            if step is not None:
                lost = self.runner.run(step, timer, bool(self.inbox.intake))
                if lost:
                    self._lose(*lost)

    # recovery
    def _lose(self, service: str, why: str) -> None:
        """Stops stepping until the next handshake. A lost cache took the tables: the running sequences wait
        again, to be recomputed. A lost compute (and nothing else since the last attach) leaves them
        running: the handshake keeps their tables if the cache kept its pool (see handshake)."""
        first = not self.recovery.active
        if first:
            log.warning("peer_lost", peer=service, running=len(self.scheduler.running), error=why)
        self._keep_tables = service in COMPUTES and (first or self._keep_tables)
        self.recovery.lost(service)
        if not self._keep_tables:
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
                with self.inbox.lock:
                    self.recovery.recovered()
                return
        with self.inbox.lock:
            error = self.recovery.expire()
        if error is not None:
            log.error("peer_unavailable", peer=self.recovery.service, error=str(error))
            seqs = self.live.all()
            # NOTE: a lost cache holds nothing to free; a lost compute leaves the tables in a live cache.
            self.live.release(seqs, free=self.recovery.service != "cache")
            tell(seqs, error)
