"""How long one compute Forward may take before compute counts as lost (hung or dead): set, or derived
from the recent steps, so that a stopped compute is noticed in seconds instead of at the RPC timeout; and
the per-reply deadline of a multi-step call."""

import threading
import time
from collections import deque

import grpc

WINDOW = 200
# Steps seen before the derived deadline applies; until then the RPC timeout does.
WARMUP = 8
FACTOR, FLOOR_S = 10.0, 5.0


class StepDeadline:
    """`timeout(tokens)`: `fixed_s` when positive; else max(FLOOR_S, FACTOR × the recent p99 step time,
    FACTOR × the recent p99 time per token × the step's tokens) — a long prefill chunk gets its due.

    NOTE: p99 over the last WINDOW steps, not the mean: a deadline near typical step times would take a
    slow step of a loaded machine for a lost compute and recompute everything again.
    """

    def __init__(self, fixed_s: float, cold_s: float) -> None:
        self.fixed_s = fixed_s
        self.cold_s = cold_s
        self._step_s: deque[float] = deque(maxlen=WINDOW)
        self._token_s: deque[float] = deque(maxlen=WINDOW)

    def observe(self, seconds: float, tokens: int) -> None:
        self._step_s.append(seconds)
        self._token_s.append(seconds / max(1, tokens))

    def timeout(self, tokens: int) -> float:
        if self.fixed_s > 0:
            return self.fixed_s
        if len(self._step_s) < WARMUP:
            return self.cold_s
        return max(FLOOR_S, FACTOR * _p99(self._step_s), FACTOR * _p99(self._token_s) * tokens)


def _p99(values: deque[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class ReplyDeadline:
    """Cancels a streaming call whose next reply does not come within `seconds` of the last one (or of
    the start): each step of a ForwardSteps call gets a step's deadline, not the whole call's. One thread
    per call; `expired` tells that it cancelled the call."""

    def __init__(self, call: grpc.Future, seconds: float) -> None:
        self.expired = False
        self._call, self._seconds = call, seconds
        self._due = time.monotonic() + seconds
        self._done = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="multi-step-deadline").start()

    def replied(self, seconds: float) -> None:
        """A reply came; the next one has `seconds`."""
        self._due = time.monotonic() + seconds

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(max(0.0, self._due - time.monotonic())):
            if time.monotonic() >= self._due:
                self.expired = True
                self._call.cancel()
                return


class StepExpired(grpc.RpcError):
    """What a ForwardSteps call cancelled by its ReplyDeadline counts as: DEADLINE_EXCEEDED (compute lost)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self._seconds = seconds

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return f"no reply of compute's ForwardSteps call within the step deadline ({self._seconds:.1f} s)"

    def trailing_metadata(self) -> tuple:
        return ()
