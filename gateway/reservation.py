"""The schedule stage: the step scheduled, and its cache calls: the Lookup of the prefixes the next
prompts may share, then a step's blocks reserved (with room for a multi-step's later steps when it may
run one), or the preempted sequences' blocks freed."""

from functools import partial

import grpc
import structlog

from gateway.fault_injection import injected
from gateway.kv_view import KVView
from gateway.live_seqs import LiveSeqs
from gateway.multi_step import can_multi_step
from gateway.recovery import PeerFault, calling
from gateway.scheduler import Scheduler
from gateway.sequence import Sequence
from gateway.step import ScheduledStep
from gateway.step_faults import fail, fail_faulty, isolate

log = structlog.get_logger()


def look_up_prefixes(scheduler: Scheduler) -> None:
    """The waiting sequences next in line learn the prefix the cache holds of them (once each), so their
    first step computes only the rest; a failed Lookup leaves them to start from 0."""
    seqs = scheduler.unlooked()
    if seqs:
        try:
            with calling("cache"):
                scheduler.kv.lookup(seqs, scheduler.running)
        except PeerFault as fault:
            log.warning("lookup_failed", error=fault.err.details())


def schedule_step(scheduler: Scheduler, live: LiveSeqs) -> ScheduledStep | None:
    """The next step, after the Lookup. A sequence whose scheduling raised fails its request (INTERNAL)
    alone; if scheduling itself raises, every request it chose from fails instead."""
    look_up_prefixes(scheduler)
    try:
        step = scheduler.schedule()
    except Exception as exc:  # noqa: BLE001
        live.fail_internal([*scheduler.running, *scheduler.waiting], exc)
        return None
    if step is not None and step.faulty:
        fail_faulty(live, step.faulty)
        step.seqs[:] = [seq for seq in step.seqs if live.holds(seq)]
    return step


def reserve_step(
    step: ScheduledStep, scheduler: Scheduler, live: LiveSeqs, max_steps: int, news: bool
) -> None:
    """Frees the preempted, or reserves the step's blocks and sets its num_steps: up to `max_steps` when the
    step may run as a multi-step (`news`: requests wait to be admitted, so it may not) and the blocks for
    the later steps were there. PeerFault if a call fails."""
    if step.preempted:
        with calling("cache"):
            scheduler.kv.free(step.preempted)
        log.info("preempted", seq_ids=[s.seq_id for s in step.preempted])
        return
    steps = multi_steps(step, scheduler, max_steps, news)
    step.num_steps = reserve(step, scheduler, live, steps - 1) + 1


def multi_steps(step: ScheduledStep, scheduler: Scheduler, max_steps: int, news: bool) -> int:
    """How many steps an all-decode step may run as one multi-step call (1: a plain Forward): while no
    request waits (for room the lookahead blocks would hold) or is new, `max_steps`, halved until the slots
    fit above the watermark."""
    kv = scheduler.kv
    if max_steps <= 1 or news or scheduler.waiting:
        return 1
    if not can_multi_step(step.seqs) or not all(map(kv.holds, step.seqs)):
        return 1
    room, steps = kv.available_blocks - scheduler.watermark, max_steps
    while (
        steps > 1
        and sum(kv.blocks_needed(seq, seq.chunk_end + seq.lookahead(steps)) for seq in step.seqs) > room
    ):
        steps //= 2
    return steps


def reserve(step: ScheduledStep, scheduler: Scheduler, live: LiveSeqs, lookahead: int = 0) -> int:
    """The step's Reserve, with slots for `lookahead` more tokens per sequence (a multi-step call's);
    returns the lookahead reserved (0 if the blocks for it were short). One refused for want of blocks
    (the admission counted on a stale Lookup) undoes the step's admissions: those sequences wait again,
    and the step runs the others. The cache changed nothing (a Reserve is all or nothing), so no block
    is leaked. One that fails otherwise (the cache refused it, or the gateway raised while making it)
    names no row: its rows are reserved again by halves (`_isolate`)."""
    kv = scheduler.kv
    try:
        with calling("cache"):
            injected("reserve", step.seqs)
            kv.reserve(step.seqs, lookahead)
        return lookahead
    except PeerFault as fault:
        if fault.lost:
            raise
        exhausted = fault.err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        if lookahead and exhausted:
            return reserve(step, scheduler, live)
        new = [seq for seq in step.seqs if not kv.holds(seq)]
        if exhausted and not new:
            raise
        if exhausted:
            log.warning("admission_undone", seq_ids=[s.seq_id for s in new], error=fault.err.details())
            _undo_admissions(step, scheduler, new)
            return 0
        error: Exception = fault
    except Exception as exc:  # noqa: BLE001 - isolated below
        error = exc
    _isolate(step, kv, live, error)
    return 0


def _isolate(step: ScheduledStep, kv: KVView, live: LiveSeqs, error: Exception) -> None:
    """A failed Reserve's rows reserved again, a half at a time (gateway/step_faults.py: isolate): a row
    whose Reserve fails alone fails its request, and the step runs the rows that were reserved (the list
    shrinks in place). A lost cache in a rerun is raised as it came."""

    def reserve_rows(rows: list[Sequence]) -> list[Sequence] | None:
        rows = [seq for seq in rows if live.holds(seq)]
        if not rows:
            return None
        with calling("cache"):
            injected("reserve", rows)
            kv.reserve(rows)
        return rows

    log.warning("reserve_fault", seq_ids=[s.seq_id for s in step.seqs], error=str(error))
    reserved = {
        seq.seq_id for rows in isolate(step.seqs, error, reserve_rows, partial(fail, live)) for seq in rows
    }
    step.seqs[:] = [seq for seq in step.seqs if seq.seq_id in reserved and live.holds(seq)]


def _undo_admissions(step: ScheduledStep, scheduler: Scheduler, new: list[Sequence]) -> None:
    """The step's new sequences wait again; the others are reserved alone (the step list shrinks in
    place: a failure from here on fails only them)."""
    scheduler.unadmit(new)
    step.seqs[:] = [seq for seq in step.seqs if scheduler.kv.holds(seq)]
    if step.seqs:
        with calling("cache"):
            scheduler.kv.reserve(step.seqs)
