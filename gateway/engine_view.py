"""What the engine shows the dashboard: a snapshot of its queues and block tables, published by the engine
thread at every turn of its loop, and running totals of the tokens it generated and found cached.

NOTE: only the engine thread writes; any thread reads. Each publication replaces one attribute with a new
immutable object (an atomic store in CPython), so a reader needs no lock and never sees half of a step.
"""

import time
from dataclasses import dataclass

from gateway.kv_view import KVView
from gateway.outputs import Output
from gateway.scheduler import Scheduler
from gateway.sequence import Sequence

# Waiting sequences a snapshot lists (the count covers all of them): a long queue stays cheap to publish.
MAX_WAITING_SHOWN = 64
# Seconds a reader's watch() keeps the sequences listed in the snapshots.
WATCH_S = 5.0


@dataclass(frozen=True, slots=True)
class SeqView:
    """One sequence as the engine saw it: who asked, how far it is, the blocks its tables hold (one table per
    KV group; none before it holds blocks)."""

    seq_id: str
    request_id: str
    tenant: str
    index: int
    prompt_tokens: int
    generated_tokens: int
    computed_tokens: int
    cached_tokens: int
    preemptions: int
    tables: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    # Whether the sequences are listed (only while watched); the counts always are.
    listed: bool = False
    running: tuple[SeqView, ...] = ()
    # The first MAX_WAITING_SHOWN in rank order; num_waiting counts them all.
    waiting: tuple[SeqView, ...] = ()
    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    # Free plus cached (evictable) blocks, as the cache service's last reply said.
    available_blocks: int = 0
    preemptions: int = 0
    # time.time() of the publication.
    at: float = 0.0

    @property
    def kv_usage(self) -> float:
        """Blocks held by tables over all blocks (cached ones count as available)."""
        return 1 - self.available_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True, slots=True)
class Totals:
    """Since the gateway started: tokens generated, and the prompt tokens of requests (counted at their
    first token) of which the prefix cache held cached_tokens."""

    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


class EngineView:
    """NOTE: listing the sequences costs the engine time on every step, in proportion to the sequences and
    their blocks, so it lists them only while a reader watches (a dashboard is open); else only counts
    (docs/operations.md, Dashboard, has the measured cost)."""

    def __init__(self) -> None:
        self.snapshot = EngineSnapshot()
        self.totals = Totals()
        self._watched_until = float("-inf")

    def watch(self, seconds: float = WATCH_S) -> None:
        """Any thread: the snapshots published in the next `seconds` list the sequences."""
        self._watched_until = time.monotonic() + seconds

    def publish(self, scheduler: Scheduler, kv: KVView) -> None:
        """Engine thread: the queues and tables as they are now, between steps."""
        # NOTE: empty queues are listed too (for nothing), so an idle engine's snapshot is never stale.
        listed = time.monotonic() < self._watched_until or not (scheduler.running or scheduler.waiting)
        waiting = sorted(scheduler.waiting, key=lambda seq: seq.rank)[:MAX_WAITING_SHOWN] if listed else []
        running = sorted(scheduler.running, key=lambda seq: seq.rank) if listed else []
        self.snapshot = EngineSnapshot(
            listed=listed,
            running=tuple(_view(seq, kv) for seq in running),
            waiting=tuple(_view(seq, kv) for seq in waiting),
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_blocks=kv.num_blocks,
            available_blocks=kv.available_blocks,
            preemptions=scheduler.num_preemptions,
            at=time.time(),
        )

    def account(self, outputs: list[tuple[Sequence, Output]]) -> None:
        """Engine thread: a step's outputs, once their tokens are appended."""
        totals = self.totals
        prompt = cached = 0
        for seq, _ in outputs:
            if seq.index == 0 and len(seq.output_ids) == 1:
                prompt, cached = prompt + len(seq.prompt_ids), cached + seq.cached_tokens
        generated = sum(len(output.token_ids) for _, output in outputs)
        self.totals = Totals(
            totals.generated_tokens + generated, totals.prompt_tokens + prompt, totals.cached_tokens + cached
        )


def _view(seq: Sequence, kv: KVView) -> SeqView:
    return SeqView(
        seq_id=seq.seq_id,
        request_id=seq.request_id,
        tenant=seq.tenant,
        index=seq.index,
        prompt_tokens=len(seq.prompt_ids),
        generated_tokens=len(seq.output_ids),
        computed_tokens=seq.num_computed,
        cached_tokens=seq.cached_tokens,
        preemptions=seq.num_preemptions,
        tables=tuple(map(tuple, kv.tables(seq))),
    )
