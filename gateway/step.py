"""What the three stages of a gateway step hand on (gateway/engine.py: Engine._step): the schedule stage's
ScheduledStep to the run stage, and each of the run stage's StepResults to the update stage — the roles
of vLLM v1's SchedulerOutput and ModelRunnerOutput.

A step is one forward of compute; a multi-step is several decode steps in one compute call
(Compute.ForwardSteps), which gives one StepResult per step. Per-row data a step carries beside its
sequences (one entry per row of `seqs`, in order) belongs in ScheduledStep; per-row data compute returns,
in StepResult.
"""

from dataclasses import dataclass, field

from gateway.sequence import Sequence
from gateway.step_timer import StepTimer
from protos import compute_pb2


@dataclass(slots=True)
class ScheduledStep:
    """The schedule stage's output: the rows of the next step and their chunks, or the sequences to
    preempt first."""

    # Each with its chunk [num_computed, chunk_end) set: decodes first, then prompt chunks.
    seqs: list[Sequence] = field(default_factory=list)
    # Sequences whose blocks must be freed (with their progress, for the prefix cache) before anything runs;
    # they wait to be recomputed. A step that preempts schedules nothing else: the available blocks are
    # only known again once the cache service has answered the Free.
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences whose own scheduling raised, with the exception, out of the step: the engine fails their
    # requests alone (gateway/step_faults.py).
    faulty: list[tuple[Sequence, Exception]] = field(default_factory=list)
    # The step's label in the step metrics, as scheduled: "decode" or "prefill".
    kind: str = "prefill"
    # Steps the compute call runs: 1, one Forward; more, a multi-step call. Set with the blocks reserved:
    # the later steps' tokens need slots in the tables.
    num_steps: int = 1

    @property
    def is_decode(self) -> bool:
        """Every sequence adds one token: no prompt chunk slows the step down."""
        return all(seq.is_decode for seq in self.seqs)


@dataclass(slots=True)
class StepResult:
    """The run stage's output for one step that compute ran: its rows, in order, and compute's reply (the
    sampled token, and logprobs when asked, of each row that sampled)."""

    seqs: list[Sequence]
    reply: compute_pb2.ForwardResponse
    # The step's phases: the update stage adds its own and records them.
    timer: StepTimer
    kind: str
    # Rows compute runs on in the same call (a multi-step's): one the update ends keeps its blocks until
    # the call is over, since compute may still write them.
    running_on: frozenset[str] = frozenset()
