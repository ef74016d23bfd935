"""A step's fault fails only its cause, in every stage of a step (gateway/step_runner.py), by one policy:

- A fault that names its rows fails their requests alone: a row's own code raising while it is scheduled or
  its token is applied, or compute refusing rows by name (common.errors.RowsRefused: it ran nothing). Where
  the stage failed as a whole (compute's refusal), the other rows run it again.
- A fault that names no row (compute answers INTERNAL, the cache fails a Reserve, the gateway raises while it
  sends the step) is bisected: each half runs the stage again on its own, a half that fails again is split
  again, and only a row that fails alone has its request failed. Every other row runs once, with the tokens
  it would have had in the step that failed.

Bounded: a named fault takes its rows out, so each rerun after one has fewer rows; a bisection of n rows
spends at most `max_reruns(n)` reruns, two per halving, which finds one faulty row among them, and rows not
resolved when they are spent fail with the last error. A lost peer is raised as it came: every row waits for
it. Code that is not one row's (scheduling as a whole, a reply compute sent malformed) fails every row it
served.

KV: a failed step may have written K/V for some of its rows, but no row's num_computed moved (it moves only
when a result is applied), so a rerun computes the same chunk again and writes the same slots; nothing the
failed step wrote is read before that. A Reserve is all or nothing at the cache, so a rerun that failed
changed no table.
"""

from collections.abc import Callable, Iterator
from typing import TypeVar

import structlog

from common.errors import from_rpc_error, refused_rows
from gateway.live_seqs import LiveSeqs
from gateway.recovery import PeerFault
from gateway.sequence import Sequence

log = structlog.get_logger()

R = TypeVar("R")
# run(rows): the stage again for these rows only (live and unfinished), its result (None: nothing to apply);
# raises as the stage does.
Run = Callable[[list[Sequence]], R | None]
# Rows whose own code raised in a stage, each with its exception.
Faulty = list[tuple[Sequence, Exception]]


def max_reruns(rows: int) -> int:
    """Reruns a bisection of `rows` rows may spend: two per halving."""
    return 2 * max(1, (rows - 1).bit_length())


def named(rows: list[Sequence], error: Exception) -> list[Sequence]:
    """The rows of a stage run on `rows` (in order) that its error names: those compute refused (none when
    the refusal names a row outside them)."""
    indices = refused_rows(error.err) if isinstance(error, PeerFault) else None
    if not indices or indices[-1] >= len(rows):
        return []
    return [rows[i] for i in indices]


class StepFaults:
    """The policy above, over the engine's live sequences."""

    def __init__(self, live: LiveSeqs) -> None:
        self.live = live

    @staticmethod
    def row(faulty: Faulty, seq: Sequence, action: Callable[[], R]) -> R | None:
        """`action()`, one row's part of a stage; if it raises, the row and its exception go to `faulty` (its
        request to fail alone) and None is returned. A lost peer is raised as it came."""
        try:
            return action()
        except PeerFault as fault:
            if fault.lost:
                raise
            faulty.append((seq, fault))
        except Exception as exc:  # noqa: BLE001 - that row's fault: its request fails alone
            faulty.append((seq, exc))
        return None

    def set_aside(self, faulty: Faulty) -> None:
        """Rows whose own code raised (while scheduled, or while their token was applied): each one's request
        fails with its exception, alone."""
        for seq, exc in faulty:
            log.warning(
                "row_fault",
                seq_id=seq.seq_id,
                request_id=seq.request_id,
                error=f"{type(exc).__name__}: {exc}",
            )
            self.fail([seq], exc)

    def isolate(self, rows: list[Sequence], error: Exception, run: Run[R]) -> Iterator[R]:
        """The results of running again, without the cause, a stage of `rows` that failed with `error`."""
        isolation = _Isolation(self, run, max_reruns(len(rows)))
        yield from isolation.settle(rows, error)
        log.warning(
            "step_fault_isolated",
            seq_ids=[seq.seq_id for seq in rows],
            failed=isolation.failed,
            reruns=max_reruns(len(rows)) - isolation.reruns,
            error=str(error),
        )

    def fail(self, seqs: list[Sequence], error: Exception) -> None:
        """Every sample of the rows' requests ends with the error: a peer's status as it came, a gateway
        exception as INTERNAL."""
        seqs = self.live.of_requests({seq.group_id for seq in seqs})
        if not seqs:
            return
        if isinstance(error, PeerFault):
            self.live.fail(seqs, from_rpc_error(error.err))
        else:
            self.live.fail_internal(seqs, error)

    def pending(self, rows: list[Sequence]) -> list[Sequence]:
        """Those of `rows` still to run: live and unfinished."""
        return [seq for seq in rows if self.live.holds(seq) and seq.finish_reason is None]


class _Isolation:
    def __init__(self, faults: StepFaults, run: Run, reruns: int) -> None:
        self.faults, self.run, self.reruns = faults, run, reruns
        self.failed: list[str] = []

    def settle(self, rows: list[Sequence], error: Exception) -> Iterator:
        """Rows of a stage that failed with `error`: those it names fail and the others run again; else one
        alone fails, and more run again in two halves."""
        if cause := named(rows, error):
            self._fail(cause, error)
            yield from self.rerun([seq for seq in rows if seq not in cause], error, counted=False)
        elif len(rows) == 1 or self.reruns == 0:
            self._fail(self.faults.pending(rows), error)
        else:
            mid = (len(rows) + 1) // 2
            for half in (rows[:mid], rows[mid:]):
                yield from self.rerun(half, error)

    def rerun(self, rows: list[Sequence], error: Exception, counted: bool = True) -> Iterator:
        rows = self.faults.pending(rows)
        if not rows:
            return
        if counted:
            if self.reruns == 0:
                self._fail(rows, error)
                return
            self.reruns -= 1
        try:
            result = self.run(rows)
        except PeerFault as fault:
            if fault.lost:
                raise
            yield from self.settle(rows, fault)
        except Exception as exc:  # noqa: BLE001 - the fault being isolated, whatever it is
            yield from self.settle(rows, exc)
        else:
            if result is not None:
                yield result

    def _fail(self, rows: list[Sequence], error: Exception) -> None:
        self.failed += [seq.seq_id for seq in rows]
        self.faults.fail(rows, error)
