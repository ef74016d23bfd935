"""A step's timer: its phases recorded apart, the step's wall time returned."""

import time

from gateway.step_timer import PHASE_SECONDS, StepTimer


def _observed(kind: str, phase: str) -> float:
    return PHASE_SECONDS.labels(kind, phase)._sum.get()


def test_finish_returns_the_steps_wall_time_not_a_phases():
    timer = StepTimer()
    before = _observed("decode", "compute_rpc")
    with timer.phase("compute_rpc"):
        time.sleep(0.01)
    time.sleep(0.05)  # outside every phase: token handling, say
    seconds = timer.finish("decode")
    recorded = _observed("decode", "compute_rpc") - before
    assert 0.01 <= recorded < seconds
    assert seconds >= 0.06
