"""Continuous batching: which sequences run in the next step, and who is preempted when blocks run out."""

from collections import deque
from dataclasses import dataclass, field

from gateway.sequence import Sequence, Status


@dataclass(slots=True)
class Step:
    is_prefill: bool
    seqs: list[Sequence]
    # Sequences whose blocks must be freed before the step runs; they wait to be recomputed.
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Prefills waiting prompts first (FCFS, under a token budget), otherwise decodes every running sequence.

    The free block count mirrors the cache service: the engine sets it from every cache reply.
    """

    def __init__(self, block_size: int, num_blocks: int, max_batched_tokens: int, max_seqs: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free_blocks = num_blocks
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def blocks_needed(self, seq: Sequence) -> int:
        """Blocks the sequence lacks to hold all its tokens (plus one to copy a shared block into)."""
        return max(0, -(-seq.num_tokens // self.block_size) - len(seq.block_table)) + seq.shares_tail

    def schedule(self) -> Step | None:
        return self._schedule_prefill() or self._schedule_decode()

    # prefill
    def _schedule_prefill(self) -> Step | None:
        seqs, tokens, free = [], 0, self.free_blocks
        while self.waiting and len(self.running) + len(seqs) < self.max_seqs:
            seq = self.waiting[0]
            new_tokens = seq.num_tokens - seq.num_computed
            need = self.blocks_needed(seq)
            if (seqs and tokens + new_tokens > self.max_batched_tokens) or need > free:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seqs.append(seq)
            tokens += new_tokens
            free -= need
        if not seqs:
            return None
        self.running.extend(seqs)
        return Step(is_prefill=True, seqs=seqs)

    # decode
    def _schedule_decode(self) -> Step | None:
        if not self.running:
            return None
        preempted = []
        free = self.free_blocks
        while sum(self.blocks_needed(seq) for seq in self.running) > free:
            victim = self.running.pop()
            free += len(victim.block_table)
            self._requeue(victim)
            preempted.append(victim)
        assert self.running, "a lone sequence always fits: max_len is capped by the pool size"
        return Step(is_prefill=False, seqs=list(self.running), preempted=preempted)

    def _requeue(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, wait at the head of the queue."""
        seq.status = Status.WAITING
        seq.block_table = []
        seq.num_computed = seq.num_synced = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Takes a finished, aborted or failed sequence out of the queues."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
