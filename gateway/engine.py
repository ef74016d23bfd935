"""The serving loop: start-up handshake, then one step = one Cache.Reserve + one Compute.Forward."""

import threading
from dataclasses import dataclass

import grpc
import structlog
from transformers import PreTrainedTokenizerBase

from common.errors import Cancelled, PagedServeError, from_rpc_error
from common.server import channel, request_metadata
from gateway.forward import forward_request
from gateway.kv_view import KVView
from gateway.lease import Lease, is_lost
from gateway.sampling import token_logprobs
from gateway.scheduler import ScheduledStep, Scheduler
from gateway.sequence import Sequence
from gateway.step_timer import StepTimer
from gateway.text_stream import TextStream
from gateway.tokenizer import Detokenizer
from protos import cache_pb2, cache_pb2_grpc, common_pb2, compute_pb2, compute_pb2_grpc, generation_pb2

log = structlog.get_logger()
HANDSHAKE_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class EngineConfig:
    cache_target: str
    compute_target: str
    block_size: int = 16
    max_batched_tokens: int = 4096
    max_seqs: int = 64
    rpc_timeout_s: float = 120.0
    session_ttl_s: float = 10.0


@dataclass(slots=True)
class Output:
    token_ids: list[int]
    finish_reason: str | None
    index: int = 0
    # Text released by these tokens (see TextStream), and per token its logprobs when asked.
    text: str = ""
    logprobs: list[generation_pb2.TokenLogprobs] | None = None


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._cache = cache_pb2_grpc.CacheStub(channel(config.cache_target))
        self._compute = compute_pb2_grpc.ComputeStub(channel(config.compute_target))
        self._cond = threading.Condition()
        self._intake: list[Sequence] = []
        self._aborts: set[str] = set()
        self._stopped = False
        self._session_lost = False
        self.lease = Lease(self._cache, config.session_ttl_s, self._lose_session, config.rpc_timeout_s)
        self._by_id: dict[str, Sequence] = {}
        self.model_info: compute_pb2.ModelInfo | None = None
        self.handle: common_pb2.PoolHandle | None = None
        self.kv: KVView | None = None
        self.scheduler: Scheduler | None = None

    # start-up
    def handshake(self) -> None:
        """Model info from compute, a pool sized for it from cache, the pool attached to compute."""
        info = self._compute.GetModelInfo(
            compute_pb2.GetModelInfoRequest(), wait_for_ready=True, timeout=HANDSHAKE_TIMEOUT_S
        )
        geometry = cache_pb2.PoolGeometry(
            num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim
        )
        handle = self._cache.CreatePool(
            cache_pb2.CreatePoolRequest(
                geometry=geometry, block_size=self.config.block_size, kv_dtype=info.dtype, model=info.model
            ),
            wait_for_ready=True,
            timeout=HANDSHAKE_TIMEOUT_S,
        )
        self._compute.AttachPool(handle, timeout=self.config.rpc_timeout_s)
        self.lease.open()
        self.model_info, self.handle = info, handle
        num_blocks = handle.shape[2]
        self.kv = KVView(
            self._cache, self.config.block_size, num_blocks, self.config.rpc_timeout_s, self.lease
        )
        self.scheduler = Scheduler(self.kv, self.config.max_batched_tokens, self.config.max_seqs)
        log.info("attached", model=info.model, dtype=info.dtype, num_blocks=num_blocks, epoch=handle.epoch)

    @property
    def max_len(self) -> int:
        """Longest sequence servable: the model's limit, or the whole pool if that is smaller."""
        return min(self.model_info.max_model_len, self.kv.num_blocks * self.config.block_size)

    # requests
    def submit(self, seq: Sequence) -> None:
        with self._cond:
            self._intake.append(seq)
            self._cond.notify()

    def abort(self, seq_id: str) -> None:
        with self._cond:
            self._aborts.add(seq_id)
            self._cond.notify()

    def stop(self) -> None:
        """Ends the loop and closes the session (the cache service frees what it still holds)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self.lease.close()

    def _lose_session(self) -> None:
        with self._cond:
            self._session_lost = True
            self._cond.notify()

    # loop
    def run(self) -> None:
        blocked = False
        while True:
            with self._cond:
                # NOTE: work that cannot be scheduled (none should exist) waits for news instead of spinning.
                runnable = self.scheduler.has_work() and not blocked
                while not (self._stopped or self._intake or self._aborts or runnable or self._session_lost):
                    self._cond.wait()
                if self._stopped:
                    return
                intake, self._intake = self._intake, []
                aborts, self._aborts = self._aborts, set()
                lost, self._session_lost = self._session_lost, False
            if lost:
                self._recover_session()
            timer = StepTimer()
            with timer.phase("schedule"):
                for seq in intake:
                    self._by_id[seq.seq_id] = seq
                    self.scheduler.add(seq)
                self._abort_now(aborts)
                step = self.scheduler.schedule()
            blocked = step is None
            if step is not None:
                self._run_step(step, timer)

    def _abort_now(self, group_ids: set[str]) -> None:
        seqs = [seq for seq in self._by_id.values() if seq.group_id in group_ids] if group_ids else []
        if seqs:
            self._release(seqs)
            log.info("aborted", seq_ids=[s.seq_id for s in seqs])
        # NOTE: wakes the RPC thread still waiting for the request's outputs, so that it ends too.
        for outbox in {id(seq.outbox): seq.outbox for seq in seqs}.values():
            outbox.put(Cancelled("the request was cancelled or its deadline passed"))

    def _run_step(self, step: ScheduledStep, timer: StepTimer) -> None:
        """One step: the cache reserves its blocks (or frees the preempted), compute runs it, then the
        tokens are appended; a failed call ends the step's sequences with the error."""
        try:
            kind = "decode" if step.is_decode else "prefill"
            with timer.phase("cache_rpc"):
                if step.preempted:
                    self.kv.free(step.preempted)
                    log.info("preempted", seq_ids=[s.seq_id for s in step.preempted])
                    return
                self.kv.reserve(step.seqs)
            chunks = [[s.request_id, s.index, s.chunk_end - s.num_computed] for s in step.seqs]
            log.debug("step", chunks=chunks)
            tables = [self.kv.block_table(seq) for seq in step.seqs]
            eos = frozenset(self.model_info.eos_token_ids)
            request = forward_request(step.seqs, tables, self.handle.epoch, eos)
            if not self.lease.held():  # the blocks may be another's by now: compute must not write them
                self._lose_session()
                return
            with timer.phase("compute_rpc"):
                reply = self._compute.Forward(
                    request, timeout=self.config.rpc_timeout_s, metadata=_ids(step.seqs)
                )
            with timer.phase("cache_rpc"):
                for seq in [seq for seq in step.seqs if seq.forks_now]:
                    self._fork(seq)
        except grpc.RpcError as err:
            if is_lost(err):
                self._lose_session()
                return
            self._fail(step.seqs or step.preempted, from_rpc_error(err))
            return
        self._advance(step, reply)
        timer.compute = reply
        timer.finish(kind)

    def _recover_session(self) -> None:
        """The cache service freed this gateway's sequences (its session lapsed, or the service restarted):
        they are preempted without a Free, and recomputed in a new session."""
        seqs = self.scheduler.preempt_all()
        self.kv.drop(list(self._by_id.values()))  # also a sequence whose preemption's Free failed
        log.error("session_lost_sequences_requeued", seq_ids=[seq.seq_id for seq in seqs])
        try:
            self.lease.open()
        except grpc.RpcError as err:
            log.error("session_open_failed", code=err.code().name, error=err.details())
            self._lose_session()

    def _fork(self, parent: Sequence) -> None:
        """After the prompt's prefill, samples 1..n-1 share the parent's blocks and run beside it."""
        children = parent.fork()
        self.kv.fork(parent, children)
        for child in children:
            self._by_id[child.seq_id] = child
        self.scheduler.add_running(children)

    def _advance(self, step: ScheduledStep, reply: compute_pb2.ForwardResponse) -> None:
        eos = frozenset(self.model_info.eos_token_ids)
        sampled = [seq for seq in step.seqs if seq.samples_now]
        for seq in step.seqs:
            seq.num_computed = seq.chunk_end
        finished, outputs = [], []
        logprobs = token_logprobs(reply, sampled)
        for seq, token, token_logprob in zip(sampled, reply.token_ids, logprobs, strict=True):
            text = self._append(seq, token, eos)
            if seq.finish_reason:
                finished.append(seq)
            per_token = None if token_logprob is None else [token_logprob]
            outputs.append(Output([token], seq.finish_reason, seq.index, text, per_token))
        # NOTE: blocks are back in the pool before the client hears that its request ended.
        self._release(finished)
        for seq, output in zip(sampled, outputs, strict=True):
            seq.outbox.put(output)

    def _append(self, seq: Sequence, token: int, eos: frozenset[int]) -> str:
        """Adds the token, sets finish_reason (stop strings first) and returns the text it releases."""
        seq.output_ids.append(token)
        if seq.text is None:  # made at the first token, so forked samples get their own
            seq.text = TextStream(Detokenizer(self.tokenizer), seq.sampling.stop)
        text = seq.text.append([token], match=seq.reached_min_tokens)
        seq.finish_reason = "stop" if seq.text.stopped else seq.stop_reason(eos)
        if seq.finish_reason:
            text += seq.text.finish(match=seq.reached_min_tokens)
        return text

    def _release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.scheduler.remove(seq)
            del self._by_id[seq.seq_id]
        self.kv.release(seqs)

    def _fail(self, seqs: list[Sequence], error: PagedServeError) -> None:
        log.error("step_failed", seq_ids=[s.seq_id for s in seqs], code=error.code.name, error=str(error))
        self._release(seqs)
        for seq in seqs:
            seq.outbox.put(error)


def _ids(seqs: list[Sequence]) -> tuple[tuple[str, str], ...]:
    return request_metadata(seq.request_id for seq in seqs)
