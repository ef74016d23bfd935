"""When a peer (cache or compute service) is lost and comes back: which failures mean a lost peer, and the
state of the wait for it — retry times with backoff, the grace period, the error past it.

The engine stops stepping while a peer is lost, requeues its running sequences for recompute and re-runs
the handshake at `next_try`; requests wait until `grace_s` has passed, then fail with `error()` and new
ones are refused until the handshake succeeds.
"""

import contextlib
import time
from collections.abc import Callable, Iterator

import grpc

from common.errors import Unavailable

# NOTE: a lost compute (its pool gone) says "no KV pool attached"/"stale pool epoch", a restarted cache
# "no pool: call CreatePool first", a cache that dropped this gateway's session "session … expired"/"unknown
# session": all name the pool, its epoch or the session, which no client error does.
_POOL_WORDS = ("pool", "epoch", "session")
_LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Waits between handshake attempts while a peer is lost, doubled up to MAX_DELAY_S: a restarted peer is
# attached within MAX_DELAY_S of serving. NOTE: a failed attempt is one refused connection (the peers are
# local, or on the cluster's network), so a short cap costs little; at 2 s it added up to 2 s to every
# compute restart.
FIRST_DELAY_S, MAX_DELAY_S = 0.05, 0.25
# NOTE: a channel whose peer was down reconnects after a backoff that grows to 120 s by default (1 s, then
# x1.6), failing every call meanwhile; capped as the handshake's attempts are.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", int(FIRST_DELAY_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(MAX_DELAY_S * 1000)),
)


class PeerFault(Exception):
    """A call to the peer `service` failed with the gRPC error `err`."""

    def __init__(self, service: str, err: grpc.RpcError) -> None:
        super().__init__(f"{service}: {err.code().name}: {err.details()}")
        self.service, self.err = service, err

    @property
    def lost(self) -> bool:
        """Whether the peer is gone or lost its pool (a restart), rather than refusing this one call."""
        code, details = self.err.code(), self.err.details() or ""
        gone = code == grpc.StatusCode.FAILED_PRECONDITION and any(w in details for w in _POOL_WORDS)
        return code in _LOST_CODES or gone

    @property
    def gone(self) -> bool:
        """Whether no step the peer was given runs any more: nothing answers at its address (UNAVAILABLE), or
        what answers runs no step on this pool (a restarted process, without one or attached to another). A
        peer past its deadline may only be stalled, and write later into the blocks of the call it was
        given."""
        code, details = self.err.code(), self.err.details() or ""
        return code == grpc.StatusCode.UNAVAILABLE or (
            code == grpc.StatusCode.FAILED_PRECONDITION and "pool" in details
        )


@contextlib.contextmanager
def calling(service: str) -> Iterator[None]:
    """Raises the gRPC errors of the calls inside as PeerFault naming `service`."""
    try:
        yield
    except grpc.RpcError as err:
        raise PeerFault(service, err) from err


class PeerRecovery:
    """ok → lost (retrying, requests wait) → expired (past the grace: requests fail, new ones refused) → ok.

    Not thread-safe: the engine loop drives it; other threads only read `active` and `expired`.
    """

    def __init__(
        self, grace_s: float, targets: dict[str, str], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.grace_s = grace_s
        self._targets = targets
        self._clock = clock
        self.service: str | None = None
        self.since = self.next_try = 0.0
        self._delay = FIRST_DELAY_S
        self.expired = False

    @property
    def active(self) -> bool:
        return self.service is not None

    def lost(self, service: str) -> None:
        """The peer `service` failed: from now on the handshake is retried (at once the first time)."""
        if not self.active:
            self.since = self.next_try = self._clock()
            self._delay = FIRST_DELAY_S
        self.service = service

    def retry_in(self) -> float:
        """Seconds until the next handshake attempt is due (0: now)."""
        return max(0.0, self.next_try - self._clock())

    def failed(self, service: str) -> None:
        """A handshake attempt failed on `service`: the next one after a doubled delay (up to MAX_DELAY_S)."""
        assert self.active
        self.service = service
        self.next_try = self._clock() + self._delay
        self._delay = min(2 * self._delay, MAX_DELAY_S)

    def expire(self) -> Unavailable | None:
        """Once, when the grace has passed: the error that ends the waiting requests."""
        if not self.active or self.expired or self._clock() - self.since < self.grace_s:
            return None
        self.expired = True
        return self.error()

    def error(self) -> Unavailable:
        down = self._clock() - self.since
        return Unavailable(
            f"{self.service} service at {self._targets[self.service]} unreachable for {down:.0f} s; "
            "retry once it is back"
        )

    def recovered(self) -> None:
        self.service, self.expired = None, False
