"""The serving loop: start-up handshake, then one step = one Cache.Reserve + one Compute.Forward."""

import threading
import time
from dataclasses import dataclass, replace

import grpc
import numpy as np
import structlog
from transformers import PreTrainedTokenizerBase

from common.errors import Cancelled, PagedServeError, from_rpc_error
from common.server import channel, request_metadata
from gateway.sampling import forward_sampling, token_logprobs
from gateway.scheduler import Scheduler, Step
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
        self._by_id: dict[str, Sequence] = {}
        self.model_info: compute_pb2.ModelInfo | None = None
        self.handle: common_pb2.PoolHandle | None = None
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
        self.model_info, self.handle = info, handle
        num_blocks = handle.shape[2]
        self.scheduler = Scheduler(
            self.config.block_size, num_blocks, self.config.max_batched_tokens, self.config.max_seqs
        )
        log.info("attached", model=info.model, dtype=info.dtype, num_blocks=num_blocks, epoch=handle.epoch)

    @property
    def max_len(self) -> int:
        """Longest sequence servable: the model's limit, or the whole pool if that is smaller."""
        return min(self.model_info.max_model_len, self.scheduler.num_blocks * self.config.block_size)

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
        with self._cond:
            self._stopped = True
            self._cond.notify()

    # loop
    def run(self) -> None:
        blocked = False
        while True:
            with self._cond:
                # NOTE: work that cannot be scheduled (none should exist) waits for news instead of spinning.
                runnable = self.scheduler.has_work() and not blocked
                while not (self._stopped or self._intake or self._aborts or runnable):
                    self._cond.wait()
                if self._stopped:
                    return
                intake, self._intake = self._intake, []
                aborts, self._aborts = self._aborts, set()
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

    def _run_step(self, step: Step, timer: StepTimer) -> None:
        try:
            kind = "decode" if step.is_decode else "prefill"
            with timer.phase("cache_rpc"):
                if step.preempted:
                    self._free(step.preempted)
                    log.info("preempted", seq_ids=[s.seq_id for s in step.preempted])
                    return
                self._reserve(step)
            chunks = [[s.request_id, s.index, s.chunk_end - s.num_computed] for s in step.seqs]
            log.debug("step", chunks=chunks)
            request = self._forward_request(step)
            with timer.phase("compute_rpc"):
                reply = self._compute.Forward(
                    request, timeout=self.config.rpc_timeout_s, metadata=_ids(step.seqs)
                )
            forks = [
                seq
                for seq in step.seqs
                if seq.sampling.n > 1 and seq.index == 0 and not seq.output_ids and seq.samples_now
            ]
            with timer.phase("cache_rpc"):
                for seq in forks:
                    self._fork(seq)
        except grpc.RpcError as err:
            self._fail(step.seqs or step.preempted, from_rpc_error(err))
            return
        self._advance(step, reply)
        timer.compute = reply
        timer.finish(kind)

    def _reserve(self, step: Step) -> None:
        """One cache call per step: allocates tables for sequences that have none (looking up the prefix
        cache over their first chunk), and reports every other sequence's new tokens and progress and grows
        its table to hold its chunk (the reply carries only the part of its table that may change)."""
        now = time.monotonic()
        new = [seq for seq in step.seqs if not seq.block_table]
        running = [seq for seq in step.seqs if seq.block_table]
        request = cache_pb2.ReserveRequest(
            allocate=[_seq_request(seq, seq.token_ids[: seq.chunk_end]) for seq in new],
            extend=[_seq_request(seq, seq.token_ids[seq.num_synced : seq.chunk_end]) for seq in running],
        )
        reply = self._cache.Reserve(request, timeout=self.config.rpc_timeout_s, metadata=_ids(step.seqs))
        for seq, table in zip((*new, *running), reply.tables, strict=True):
            assert seq.seq_id == table.seq_id, (seq.seq_id, table.seq_id)
            assert table.first_block <= len(seq.block_table), (seq.seq_id, table.first_block)
            seq.block_table[table.first_block :] = table.block_ids
            seq.num_synced, seq.shares_tail = seq.chunk_end, False
            seq.num_computed = max(seq.num_computed, table.cached_tokens)
            if seq.scheduled_at is None:
                seq.scheduled_at, seq.cached_tokens = now, table.cached_tokens
        self.scheduler.free_blocks = reply.available_blocks

    def _fork(self, parent: Sequence) -> None:
        """After the prompt's prefill, samples 1..n-1 share the parent's blocks; each recomputes the last
        prompt token (copying its block on write) to sample its own first token with seed + index."""
        child_ids = [f"{parent.seq_id}/{index}" for index in range(1, parent.sampling.n)]
        reply = self._cache.Fork(
            cache_pb2.ForkRequest(parent_id=parent.seq_id, child_ids=child_ids),
            timeout=self.config.rpc_timeout_s,
            metadata=_ids([parent]),
        )
        parent.shares_tail = True
        seed = parent.sampling.seed
        for index, table in enumerate(reply.tables, start=1):
            child = Sequence(
                seq_id=table.seq_id,
                prompt_ids=parent.prompt_ids,
                sampling=replace(parent.sampling, seed=None if seed is None else seed + index),
                max_len=parent.max_len,
                num_computed=parent.num_tokens - 1,
                block_table=list(table.block_ids),
                cached_tokens=parent.cached_tokens,
                cache_salt=parent.cache_salt,
                request_id=parent.request_id,
                priority=parent.priority,
                arrival=parent.arrival,
                scheduled_at=parent.scheduled_at,
                num_synced=parent.num_tokens,
                shares_tail=True,
                index=index,
                group_id=parent.group_id,
                status=parent.status,
                outbox=parent.outbox,
            )
            self._by_id[child.seq_id] = child
            self.scheduler.running.append(child)
        self.scheduler.free_blocks = reply.available_blocks

    def _forward_request(self, step: Step) -> compute_pb2.ForwardRequest:
        bs = self.config.block_size
        seqs = step.seqs
        width = max(len(seq.block_table) for seq in seqs)
        tables = np.full((len(seqs), width), -1, dtype=np.int64)
        token_ids, positions, slots, q_lens = [], [], [], []
        for i, seq in enumerate(seqs):
            table = np.asarray(seq.block_table, dtype=np.int64)
            tables[i, : len(table)] = table
            pos = np.arange(seq.num_computed, seq.chunk_end, dtype=np.int64)
            token_ids.extend(seq.token_ids[seq.num_computed : seq.chunk_end])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            q_lens.append(len(pos))
        return compute_pb2.ForwardRequest(
            pool_epoch=self.handle.epoch,
            token_ids=token_ids,
            positions=np.concatenate(positions).tolist(),
            cu_seqlens_q=np.concatenate([[0], np.cumsum(q_lens)]).tolist(),
            context_lens=[seq.chunk_end for seq in seqs],
            block_tables=tables.ravel().tolist(),
            block_table_width=width,
            slot_mapping=np.concatenate(slots).tolist(),
            sample=[seq.samples_now for seq in seqs],
            **forward_sampling(
                [seq for seq in seqs if seq.samples_now], frozenset(self.model_info.eos_token_ids)
            ),
        )

    def _advance(self, step: Step, reply: compute_pb2.ForwardResponse) -> None:
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
        held = [seq for seq in seqs if seq.block_table]
        if held:
            try:
                self._free(held)
            except grpc.RpcError as err:
                log.error("free_failed", seq_ids=[s.seq_id for s in held], error=err.details())

    def _free(self, seqs: list[Sequence]) -> None:
        """Releases the sequences' blocks; their written full blocks stay in the prefix cache."""
        request = cache_pb2.FreeRequest(
            seq_ids=[s.seq_id for s in seqs], num_computed={s.seq_id: s.num_computed for s in seqs}
        )
        reply = self._cache.Free(request, timeout=self.config.rpc_timeout_s, metadata=_ids(seqs))
        self.scheduler.free_blocks = reply.available_blocks
        for seq in seqs:
            seq.drop_kv()

    def _fail(self, seqs: list[Sequence], error: PagedServeError) -> None:
        log.error("step_failed", seq_ids=[s.seq_id for s in seqs], code=error.code.name, error=str(error))
        self._release(seqs)
        for seq in seqs:
            seq.outbox.put(error)


def _ids(seqs: list[Sequence]) -> tuple[tuple[str, str], ...]:
    return request_metadata(seq.request_id for seq in seqs)


def _seq_request(seq: Sequence, new_tokens: list[int]) -> cache_pb2.SequenceRequest:
    return cache_pb2.SequenceRequest(
        seq_id=seq.seq_id,
        num_tokens=seq.chunk_end,
        token_ids=new_tokens,
        num_computed=seq.num_computed,
        cache_salt=seq.cache_salt,
    )
