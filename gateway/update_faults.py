"""The update stage's faults (gateway/step_faults.py): a row whose samples cannot fork, or whose token
cannot be applied, fails its request alone; the step's other rows get their tokens."""

from gateway.executor import StepExecutor
from gateway.live_seqs import LiveSeqs
from gateway.outputs import Output
from gateway.recovery import PeerFault, calling
from gateway.sequence import Sequence
from gateway.step_faults import fail_faulty

Faulty = list[tuple[Sequence, Exception]]


def fork_isolated(live: LiveSeqs, seq: Sequence, faulty: Faulty) -> None:
    """The samples of `seq`'s request fork from it; if that fails without losing the cache, its request
    goes to `faulty` (a lost cache is raised: every row waits for it)."""
    try:
        with calling("cache"):
            live.fork(seq)
    except PeerFault as fault:
        if fault.lost:
            raise
        faulty.append((seq, fault))
    except Exception as exc:  # noqa: BLE001 - that row's fault: its request fails alone
        faulty.append((seq, exc))


def fail_rows(
    live: LiveSeqs,
    executor: StepExecutor,
    faulty: Faulty,
    outputs: list[tuple[Sequence, Output]],
    running_on: frozenset[str],
    deferred: Faulty,
) -> list[tuple[Sequence, Output]]:
    """The requests of the update's faulty rows fail alone; returns the other requests' outputs. A row
    compute still runs on (a multi-step call's) ends the call and goes to `deferred`: its request fails
    once the call is over, when compute no longer writes its blocks."""
    now = [(seq, exc) for seq, exc in faulty if seq.seq_id not in running_on]
    later = [(seq, exc) for seq, exc in faulty if seq.seq_id in running_on]
    if later:
        executor.end_call()
        deferred += later
    fail_faulty(live, now)
    doomed = {seq.group_id for seq, _ in deferred}
    return [(seq, output) for seq, output in outputs if live.holds(seq) and seq.group_id not in doomed]
