"""Resumable streams: a request across its attempts. When a stream breaks with UNAVAILABLE (its gateway died,
drained or lost a peer, or could not be reached), the request is sent again, to the next gateway of the
client's targets (the same one, once it is back, when there is only one), with what was received of each
sample (`GenerateRequest.resume`), and the gateway generates on from there: the caller sees one seamless
stream. The contract is docs/api.md's "Resuming a stream"."""

import logging
import threading
import time
from collections.abc import Sequence

import grpc

from protos import generation_pb2

# The statuses that say the gateway could not finish, not that the request is at fault.
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
# Waits between attempts while no gateway answers: doubled from the first to the longest.
FIRST_DELAY_S, MAX_DELAY_S = 0.1, 2.0
# How long a broken request keeps trying while no attempt receives anything (0: it never resumes).
RESUME_TIMEOUT_S = 60.0
# NOTE: a channel whose gateway was down reconnects after a backoff that grows to 120 s by default, failing
# every call meanwhile: capped, a restarted gateway is found within MAX_DELAY_S of serving.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", int(FIRST_DELAY_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(MAX_DELAY_S * 1000)),
)
log = logging.getLogger(__name__)


def target_list(targets: str | Sequence[str]) -> list[str]:
    """The gateways: a list, or one string of comma-separated HOST:PORTs; ValueError when empty."""
    found = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    found = [t for t in found if t]
    if not found:
        raise ValueError("no gateway target given: pass HOST:PORT, or several")
    return found


class Targets:
    """Which of the gateways a request goes to: the current one, until an attempt on it breaks and the next
    one (in order, round) becomes current, for every request of the client."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.count = len(names)
        self._current = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> int:
        return self._current

    def failed(self, index: int) -> None:
        with self._lock:
            if self._current == index:
                self._current = (index + 1) % self.count


class Call:
    """One request and what its attempts received: the request each attempt sends (the original one, then
    with `resume`), and after a broken attempt whether to try again and when."""

    def __init__(
        self,
        request: generation_pb2.GenerateRequest,
        targets: Targets,
        resume_timeout: float = RESUME_TIMEOUT_S,
        timeout: float | None = None,
    ) -> None:
        self._request = generation_pb2.GenerateRequest()
        self._request.CopyFrom(request)
        self._n = request.sampling.n if request.sampling.HasField("n") else 1
        self._targets, self._resume_timeout = targets, resume_timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._received: dict[int, list[int]] = {}
        self._finished: set[int] = set()
        self._failures = 0
        # The break the attempts since the last response went on after (None: the last attempt received).
        self._break: grpc.RpcError | None = None
        self._heard_at = time.monotonic()
        # Times the stream went on after a break; the target of the current attempt.
        self.resumes = 0
        self.target = targets.current

    @property
    def done(self) -> bool:
        """Every sample's last response was received (an `n` of 0 is never done: the gateway refuses it,
        and the refusal is the answer)."""
        return len(self._finished) >= max(self._n, 1)

    def attempt(self) -> tuple[int, generation_pb2.GenerateRequest, float | None]:
        """The next attempt: the target's index, the request, its timeout (what is left of the call's)."""
        self.target = self._targets.current
        left = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        if not (self._received or self._finished):
            return self.target, self._request, left
        request = generation_pb2.GenerateRequest()
        request.CopyFrom(self._request)
        for index in sorted(self._received.keys() | self._finished):
            request.resume.add(
                index=index, token_ids=self._received.get(index, ()), finished=index in self._finished
            )
        return self.target, request, left

    def received(self, response: generation_pb2.GenerateResponse) -> None:
        """Notes a response of the current attempt."""
        # NOTE: the id a resume names (the gateway's own when none was given): a gateway takes over a
        # request of that id still running there.
        self._request.request_id = self._request.request_id or response.request_id
        self._received.setdefault(response.index, []).extend(response.token_ids)
        if response.finish_reason:
            self._finished.add(response.index)
        if self._failures:
            self.resumes += 1
        self._failures, self._heard_at, self._break = 0, time.monotonic(), None

    def retry_in(self, err: grpc.RpcError) -> float | None:
        """After the current attempt broke with `err`: the seconds to wait before the next one (on the next
        target), or None when the error is the caller's (not resumable, resuming off, out of time)."""
        now = time.monotonic()
        if err.code() not in RESUMABLE or now - self._heard_at >= self._resume_timeout:
            return None
        if self._deadline is not None and now >= self._deadline:
            return None
        targets = self._targets
        targets.failed(self.target)
        # NOTE: the first retry goes at once to another gateway; a round of failures waits, doubling.
        rounds = self._failures // targets.count
        delay = 0.0 if rounds == 0 and targets.count > 1 else min(FIRST_DELAY_S * 2**rounds, MAX_DELAY_S)
        # NOTE: the break is a warning; the attempts that find no gateway after it are not.
        log.log(
            logging.INFO if self._failures else logging.WARNING,
            "request %s on %s: %s: %s; resuming on %s in %.1f s",
            self._request.request_id or "(no id yet)", targets.names[self.target], err.code().name,
            err.details(), targets.names[targets.current], delay,
        )  # fmt: skip
        self._failures += 1
        self._break = err
        return delay

    def reported(self, err: grpc.RpcError) -> grpc.RpcError:
        """The error to raise for a request that ends with err: the break it was resuming after when the
        request's timeout passed meanwhile (what went wrong, not that time ran out), else err."""
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self._break is not None:
            return self._break
        return err
