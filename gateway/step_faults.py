"""A step fault fails only its cause, in each stage of a step (gateway/engine.py):

- run: a step whose run stage fails without losing a peer (compute answers with an error such as INTERNAL,
  or the gateway's own code raises while it sends the step) does not say which row caused it, so its rows
  are bisected (`isolate`): each half runs again as a step of its own, a half that fails again is split
  again, and only a row that fails alone has its request failed. Every other row runs once, with the tokens
  it would have had in the step that failed.
- schedule: the Reserve of a step is bisected the same way when it fails for another reason than blocks
  (gateway/reservation.py); a sequence whose own chunk cannot be sized is left out of the step
  (ScheduledStep.faulty, gateway/scheduler.py) and fails alone (`fail_faulty`).
- update: a row whose result cannot be applied (its token appended, its samples forked) fails alone; the
  step's other rows get their tokens (Engine._update).

Bounded: at most `max_reruns(n)` reruns for a step of n rows, two per halving, which finds one faulty row
among them; rows not yet resolved when the reruns are spent fail with the last error. Code that is not one
row's (scheduling as a whole, a reply compute sent malformed) still fails every row it served.

KV: the failed step may have written K/V for some of its rows, but no row's num_computed moved (it moves
only when a result is applied, gateway/outputs.py: advance), so a rerun computes the same chunk again and
writes the same slots; nothing the failed step wrote is read before that. A Reserve is all or nothing at the
cache, so a half that failed changed no table.
"""

from collections.abc import Callable, Iterator
from contextlib import closing
from functools import partial
from typing import Generic, TypeVar

import structlog

from common.errors import from_rpc_error
from gateway.executor import StepExecutor
from gateway.live_seqs import LiveSeqs
from gateway.recovery import PeerFault
from gateway.sequence import Sequence
from gateway.step import ScheduledStep, StepResult
from gateway.step_timer import StepTimer

log = structlog.get_logger()

R = TypeVar("R")
# run(rows): runs the rows again (as one step, or one Reserve) and returns its result (None: none of them
# is live any more); raises as the stage does.
Run = Callable[[list[Sequence]], R | None]
# fail(rows, error): ends the requests of rows that failed alone.
Fail = Callable[[list[Sequence], Exception], None]


def run_isolated(
    executor: StepExecutor, live: LiveSeqs, step: ScheduledStep, timer: StepTimer
) -> Iterator[StepResult]:
    """The run stage's results (StepExecutor.run); if it fails without losing a peer, those of its rows'
    reruns without the cause (`isolate`). A lost peer is raised as it came."""
    try:
        with closing(executor.run(step, timer, live.refuse)) as results:
            yield from results
        return
    except PeerFault as fault:
        if fault.lost:
            raise
        error: Exception = fault
    except Exception as exc:  # noqa: BLE001 - isolated below
        error = exc
    log.warning("step_fault", seq_ids=[s.seq_id for s in step.seqs], error=str(error))
    rerun = partial(_rerun, executor, live, step.kind)
    yield from isolate(pending(step.seqs, live.holds), error, rerun, partial(fail, live))


def _rerun(executor: StepExecutor, live: LiveSeqs, kind: str, seqs: list[Sequence]) -> StepResult | None:
    """Those of `seqs` still live, run as a step of their own (a Forward): its result."""
    rows = [seq for seq in seqs if live.holds(seq)]
    if not rows:
        return None
    with closing(executor.run(ScheduledStep(rows, kind=kind), StepTimer(), live.refuse)) as results:
        return next(results, None)


def fail(live: LiveSeqs, seqs: list[Sequence], error: Exception) -> None:
    """Rows that failed alone: every sample of their requests ends with the step's error."""
    seqs = live.of_requests({seq.group_id for seq in seqs})
    if not seqs:
        return
    if isinstance(error, PeerFault):
        live.fail(seqs, from_rpc_error(error.err))
    else:
        live.fail_internal(seqs, error)


def fail_faulty(live: LiveSeqs, faulty: list[tuple[Sequence, Exception]]) -> None:
    """Rows whose own code raised (in the schedule or update stage): each one's request fails with its
    exception, alone."""
    for seq, exc in faulty:
        log.warning(
            "row_fault", seq_id=seq.seq_id, request_id=seq.request_id, error=f"{type(exc).__name__}: {exc}"
        )
        fail(live, [seq], exc)


def max_reruns(rows: int) -> int:
    """Reruns allowed for a failed step of `rows` rows: two per halving."""
    return 2 * max(1, (rows - 1).bit_length())


def pending(seqs: list[Sequence], live: Callable[[Sequence], bool]) -> list[Sequence]:
    """The rows of a failed step still to run: live and unfinished. A row a multi-step call had already
    advanced (its chunk computed by an earlier step of the call) gets its next decode token as its chunk."""
    rows = [seq for seq in seqs if live(seq) and seq.finish_reason is None]
    for seq in rows:
        if seq.chunk_end <= seq.num_computed:
            seq.chunk_end = seq.num_tokens
    return rows


def isolate(rows: list[Sequence], error: Exception, run: Run[R], fail: Fail) -> Iterator[R]:
    """The results of the reruns of a stage of `rows` that failed with `error` (see the module). A lost
    peer in a rerun is raised as it came: the rows not yet run wait for the peer, as after any lost step."""
    bisection = _Bisection(run, fail, max_reruns(len(rows)))
    yield from bisection.split(rows, error)
    log.warning(
        "step_fault_isolated",
        seq_ids=[seq.seq_id for seq in rows],
        failed=bisection.failed,
        reruns=max_reruns(len(rows)) - bisection.reruns,
        error=str(error),
    )


class _Bisection(Generic[R]):
    def __init__(self, run: Run[R], fail: Fail, reruns: int) -> None:
        self.run, self.fail, self.reruns = run, fail, reruns
        self.failed: list[str] = []

    def split(self, rows: list[Sequence], error: Exception) -> Iterator[R]:
        """Rows of a step that failed with `error`: one alone fails; more run again in two halves."""
        if len(rows) == 1 or self.reruns == 0:
            self.failed += [seq.seq_id for seq in rows]
            self.fail(rows, error)
            return
        mid = (len(rows) + 1) // 2
        for half in (rows[:mid], rows[mid:]):
            yield from self.rerun(half, error)

    def rerun(self, rows: list[Sequence], error: Exception) -> Iterator[R]:
        if self.reruns == 0:
            yield from self.split(rows, error)
            return
        self.reruns -= 1
        try:
            result = self.run(rows)
        except PeerFault as fault:
            if fault.lost:
                raise
            yield from self.split(rows, fault)
        except Exception as exc:  # noqa: BLE001 - the fault being isolated, whatever it is
            yield from self.split(rows, exc)
        else:
            if result is not None:
                yield result
