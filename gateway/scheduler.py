"""Continuous batching with chunked prefill: which sequences run in the next step, and how many of their
tokens; who is preempted when blocks run out."""

from gateway.kv_view import KVView
from gateway.sequence import Sequence, Status
from gateway.step import ScheduledStep
from gateway.step_pace import StepPace, StepShape
from gateway.vision import EncoderBudget


class Scheduler:
    """Every step packs, under `max_batched_tokens` and `max_seqs`: the running decodes, then the next chunks
    of running prompts, then first chunks of waiting ones (admitted in rank order while the blocks of their
    chunk are free). Rank: lower priority value first, then arrival. A step with decodes takes at most
    `prefill_tokens_with_decodes` prompt tokens, so that running streams do not wait behind a long prefill;
    with a `pace`, fewer when its fit of the step times says more would take the step past its target.
    Both hold as given beside `pace_streams` decodes or more; beside fewer, a step may take pace_streams /
    decodes times as many prompt tokens and as long (see `_prompt_budget`).

    Blocks (available, needed, room in a table) are the KV view's answers; the scheduler writes none of it.
    A waiting prompt's prefix hits on blocks a table holds (or a prompt admitted before it in the step
    takes) cost no block; a hit on a cached block nobody holds costs one (it leaves the evictable ones).
    """

    def __init__(
        self,
        kv: KVView,
        max_batched_tokens: int,
        max_seqs: int,
        prefill_tokens_with_decodes: int = 0,
        pace: StepPace | None = None,
        pace_streams: int = 1,
    ) -> None:
        assert max_batched_tokens > 0 and max_seqs > 0 and prefill_tokens_with_decodes >= 0
        assert pace_streams > 0, pace_streams
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        # 0: no separate cap (a step's prompt tokens take what its decodes leave of max_batched_tokens).
        self.prefill_tokens_with_decodes = prefill_tokens_with_decodes or max_batched_tokens
        self.pace = pace
        self.pace_streams = pace_streams
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # The image tokens a step may cover (gateway.vision); one without a limit by default.
        self.encoder = EncoderBudget(0)

    @property
    def watermark(self) -> int:
        """NOTE: admitting a new prompt leaves this many blocks free for the running sequences to grow into,
        so that admissions do not preempt at once what they just admitted."""
        return max(1, self.kv.num_blocks // 100)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seqs: list[Sequence]) -> None:
        """Sequences that hold blocks already (samples forked from a running one) join the running ones."""
        assert all(seq.status is Status.RUNNING for seq in seqs), [seq.seq_id for seq in seqs]
        self.running.extend(seqs)

    def _tokens(self, seq: Sequence, budget: int, free: int) -> int:
        """How many of the sequence's tokens to compute (after its computed or cached ones, its chunk_start)
        fit in `budget` tokens and `free` blocks: cached prefix tokens cost no budget."""
        return max(0, min(seq.num_tokens - seq.chunk_start, budget, self.kv.room(seq, free)))

    def _chunk(self, seq: Sequence, budget: int, free: int) -> int:
        """`_tokens`, stopped before an image the step's encoder budget has no room for."""
        n = self._tokens(seq, budget, free)
        return self.encoder.fit(seq, n) if seq.images else n

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when there is nothing to run. A sequence whose own chunk cannot be sized
        (the code raises for it) is left out, in the step's `faulty`, and the others are scheduled."""
        budget, free, step = self.max_batched_tokens, self.kv.available_blocks, ScheduledStep()
        self.encoder.start_step()
        # running: decodes first, then the next chunks of partly computed prompts
        running = sorted(self.running, key=lambda s: s.rank)
        for seq in sorted(running, key=_prefills):
            budget = self._prompt_budget(step, budget, seq.chunk_start) if _prefills(seq) else budget
            if budget == 0:
                break
            try:
                room = self._tokens(seq, budget, free)
                n = self.encoder.fit(seq, room) if seq.images else room
                taken = self._take(seq, n) if n else 0
            except Exception as exc:  # noqa: BLE001 - that sequence's fault: the engine fails it alone
                step.faulty.append((seq, exc))
                continue
            if room == 0:
                return ScheduledStep(preempted=[self._preempt(running[-1])], faulty=step.faulty)
            if n == 0:
                continue  # its next image waits for a step with encoder budget left
            budget, free = budget - n, free - taken
            step.seqs.append(seq)
        first = min(self.waiting, key=lambda s: s.rank, default=None)
        budget = self._prompt_budget(step, budget, first.chunk_start if first else 0)
        self._admit(step, budget, free)
        step.kind = "decode" if step.is_decode else "prefill"
        if step.kind == "prefill":
            # NOTE: this step's prompt chunks write blocks the waiting prompts may share: look them up again.
            for seq in self.waiting:
                seq.forget_prefix()
        return step if step.seqs or step.faulty else None

    def multi_steps(self, step: ScheduledStep, max_steps: int, news: bool, waiting: bool = True) -> int:
        """How many steps an all-decode step may run as one multi-step call (1: a plain Forward): while no
        request waits (for room the lookahead blocks would hold; `waiting` False: none is admitted before the
        call ends anyway) or is new (`news`), `max_steps`, halved until the slots its rows may still write
        fit above the watermark."""
        kv = self.kv
        if max_steps <= 1 or news or (waiting and self.waiting):
            return 1
        if not can_multi_step(step.seqs) or not all(map(kv.holds, step.seqs)):
            return 1
        room, steps = kv.available_blocks - self.watermark, max_steps
        while steps > 1 and self._lookahead_blocks(step, steps) > room:
            steps //= 2
        return steps

    def _lookahead_blocks(self, step: ScheduledStep, steps: int) -> int:
        return sum(self.kv.blocks_needed(s, s.chunk_end + s.lookahead(steps)) for s in step.seqs)

    def _prompt_budget(self, step: ScheduledStep, budget: int, start: int) -> int:
        """What is left of `budget` for prompt tokens (the next from context position `start`): with decodes
        in the step, at most prefill_tokens_with_decodes of prompt tokens in all, and at most what the pace
        gives beside those decodes, each stretched by pace_streams / decodes where that is above 1.

        NOTE: a step holds every running stream for its length, so what it costs them is its length times
        the streams that wait. The stretch keeps that cost what a step at the cap and target costs
        pace_streams streams: a burst's first few streams wait once, longer, while the rest of the burst
        is prefilled in one step, instead of every early stream waiting behind each of several paced steps
        (so that few of the burst's token gaps are long: docs/configuration.md, Prompt chunks sized by
        time)."""
        decodes = [seq for seq in step.seqs if seq.is_decode]
        if not decodes:
            return budget
        stretch = max(1.0, self.pace_streams / len(decodes))
        cap = int(self.prefill_tokens_with_decodes * stretch)
        if self.pace is not None:
            paced = self.pace.prompt_tokens(StepShape.of(decodes), start, stretch)
            cap = cap if paced is None else min(cap, paced)
        prompt_tokens = sum(seq.chunk_len for seq in step.seqs) - len(decodes)
        return max(0, min(budget, cap - prompt_tokens))

    def _admit(self, step: ScheduledStep, budget: int, free: int) -> None:
        """First chunks of waiting sequences, in rank order; nobody overtakes a request that does not fit.
        A prefix hit takes a block only if neither a table nor an earlier admission holds it."""
        slots = sum(seq.num_slots for seq in self.running)
        held = self.kv.held_blocks() if any(_hit_blocks(seq) for seq in self.waiting) else set()
        for seq in sorted(self.waiting, key=lambda s: s.rank):
            try:
                revived = len(set(_hit_blocks(seq)) - held)
                room = free - revived - (self.watermark if self.running else 0)
                n = self._chunk(seq, budget, room)
                # NOTE: a preempted sequence comes back only once its whole context fits, or it would take
                # the blocks back a chunk at a time and be preempted again at once (thrashing).
                refit = seq.num_preemptions == 0 or self.kv.blocks_to_hold(seq, seq.num_tokens) <= room
                fits = n > 0 and refit and slots + seq.num_slots <= self.max_seqs
                taken = self._take(seq, n) if fits else 0
            except Exception as exc:  # noqa: BLE001 - that sequence's fault: the engine fails it alone
                step.faulty.append((seq, exc))
                continue
            if not fits:
                break
            budget, slots = budget - n, slots + seq.num_slots
            free -= taken + revived
            held.update(_hit_blocks(seq))
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = Status.RUNNING
            step.seqs.append(seq)

    def _take(self, seq: Sequence, n: int) -> int:
        """Schedules n tokens of the sequence; returns the blocks that takes (at most)."""
        seq.chunk_end = seq.chunk_start + n
        return self.kv.blocks_needed(seq, seq.chunk_end)

    def _preempt(self, seq: Sequence) -> Sequence:
        """Preemption by recompute: the engine frees the blocks; the tokens are kept and computed again when
        the sequence is admitted again (in rank order, so usually before anything newer)."""
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.append(seq)
        self.num_preemptions += 1
        return seq

    def unadmit(self, seqs: list[Sequence]) -> None:
        """Newly admitted sequences whose Reserve was refused wait again, in their place (by rank), and
        look their prefix up again."""
        for seq in seqs:
            assert seq.status is Status.RUNNING and seq.num_computed == 0, seq.seq_id
            self.running.remove(seq)
            seq.status, seq.chunk_end = Status.WAITING, 0
            seq.forget_prefix()
            self.waiting.append(seq)

    def unlooked(self) -> list[Sequence]:
        """Waiting sequences the scheduler may admit next (the first max_seqs in rank order) whose cached
        prefix is not looked up yet."""
        ranked = sorted(self.waiting, key=lambda s: s.rank)[: self.max_seqs]
        return [seq for seq in ranked if seq.prefix_hit is None]

    def requeue_running(self) -> None:
        """Every running sequence back to waiting, tokens kept, to be computed again (a peer was lost)."""
        for seq in self.running:
            seq.status = Status.WAITING
        self.waiting.extend(self.running)
        self.running = []

    def remove(self, seq: Sequence) -> None:
        """Takes a finished, aborted or failed sequence out of the queues."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED


def can_multi_step(seqs: list[Sequence]) -> bool:
    """Whether the step can run as several (a multi-step: one Compute.ForwardSteps call that runs up to k
    steps, compute feeding each row's sampled token into the next): every row decodes one token and samples
    it, none forks, none is constrained (its next mask follows the token it samples: gateway.structured)."""
    return all(
        seq.is_decode and seq.samples_now and not seq.forks_now and seq.constraint is None for seq in seqs
    )


def _prefills(seq: Sequence) -> bool:
    """More than one token to compute: the sequence's next chunk is (part of) its prompt."""
    return seq.num_tokens - seq.num_computed > 1


def _hit_blocks(seq: Sequence) -> tuple[int, ...]:
    """The blocks of a waiting sequence's prefix hit (none if not looked up)."""
    return seq.prefix_hit.blocks if seq.prefix_hit is not None else ()
