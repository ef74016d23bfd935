"""The gateway's session (lease) with the cache service: opened at the handshake, renewed from its own
thread every TTL/3, closed on shutdown. The cache service frees the sequences of a session that is not
renewed within its TTL, so a gateway that dies (kill -9) holds no blocks for longer than that."""

import threading
import time
import uuid
from collections.abc import Callable

import grpc
import structlog

from protos import cache_pb2, cache_pb2_grpc

log = structlog.get_logger()
# A renewal that failed for another reason (UNAVAILABLE, a deadline) is retried this much sooner.
RETRY_FRACTION = 10


def is_lost(err: grpc.RpcError) -> bool:
    """Whether a Cache call failed because the session is gone (lapsed, or unknown to a restarted cache
    service): every sequence it held is freed there. NOTE: the cache service's other FAILED_PRECONDITION
    statuses (no pool, a stale epoch) never name a session."""
    return err.code() == grpc.StatusCode.FAILED_PRECONDITION and "session" in (err.details() or "")


class Lease:
    """One session at a time; `session_id` is empty (and `epoch` 0) until `open`; `epoch` is the one the
    cache gave this opening, which every Forward names (compute refuses steps of a session that ended).
    `on_lost` is called (from the renewal thread, once per session) when a renewal finds the session gone;
    the engine then drops its tables and calls `open` again."""

    def __init__(
        self,
        stub: cache_pb2_grpc.CacheStub,
        ttl_s: float,
        on_lost: Callable[[], None],
        rpc_timeout_s: float = 120.0,
    ) -> None:
        assert ttl_s > 0, ttl_s
        self.session_id = ""
        self.epoch = 0
        self.ttl_s = ttl_s
        self._requested_ttl_s = ttl_s
        self._stub = stub
        self._on_lost = on_lost
        self._timeout = rpc_timeout_s
        self._closed = threading.Event()
        self._reported = ""
        self._held_until = 0.0
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        """Opens a new session (a fresh id) and renews it from now on; an earlier one is closed first, so
        that the sequence ids it held are free again (the gateway's tables are dropped before). Called at
        every handshake, and again after a loss; raises grpc.RpcError if the cache service refuses or cannot
        be reached."""
        if self.session_id:
            self._close_session(self.session_id)
        session_id, sent = uuid.uuid4().hex, time.monotonic()
        request = cache_pb2.OpenSessionRequest(session_id=session_id, ttl_s=self._requested_ttl_s)
        reply = self._stub.OpenSession(request, timeout=self._timeout, wait_for_ready=True)
        self.session_id, self.epoch, self.ttl_s = session_id, reply.epoch, reply.ttl_s
        self._held_until = sent + reply.ttl_s
        log.info("session_opened", session_id=session_id, ttl_s=reply.ttl_s)
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew_forever, name="lease", daemon=True)
            self._thread.start()

    def held(self) -> bool:
        """Whether the session is surely still open: less than a TTL has passed since the sending of the
        last open or renewal the cache service granted (its deadline runs from a later moment)."""
        return time.monotonic() < self._held_until

    def close(self) -> None:
        """Stops renewing and closes the session, so the cache service frees its sequences at once."""
        self._closed.set()
        if self.session_id:
            self._close_session(self.session_id)

    def _close_session(self, session_id: str) -> None:
        """Best effort: a session not closed lapses within its TTL all the same; one the cache service does
        not know (it restarted) holds nothing."""
        try:
            self._stub.CloseSession(cache_pb2.CloseSessionRequest(session_id=session_id), timeout=5.0)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("session_close_failed", session_id=session_id, error=err.details())

    def _renew_forever(self) -> None:
        delay = self.ttl_s / 3
        while not self._closed.wait(delay):
            delay = self.ttl_s / 3 if self._renew() else self.ttl_s / RETRY_FRACTION

    def _renew(self) -> bool:
        """One renewal; False if it should be retried soon."""
        session_id = self.session_id
        if session_id == self._reported:
            return True
        try:
            request, sent = cache_pb2.RenewSessionRequest(session_id=session_id), time.monotonic()
            self._stub.RenewSession(request, timeout=self.ttl_s / 3)
            if session_id == self.session_id:
                self._held_until = sent + self.ttl_s
            return True
        except grpc.RpcError as err:
            if not is_lost(err):
                log.warning("session_renewal_failed", session_id=session_id, code=err.code().name)
                return False
            log.error("session_lost", session_id=session_id, error=err.details())
            self._reported = session_id
            if session_id == self.session_id:  # not reopened meanwhile (the engine saw the loss first)
                self._on_lost()
            return True
