"""The gateway's admission gate: open until shutdown begins, then draining: new requests are refused while
the admitted ones run to their end, for at most the drain timeout."""

import threading

from common.errors import Unavailable
from gateway.sequence import Sequence

DRAINING = "draining: the gateway is shutting down; retry on another gateway or once it is back"
CUT = "the gateway shut down before this request finished (--drain-timeout passed); retry it"


class Admission:
    """The requests admitted and not yet ended, by sequence id."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running: dict[str, Sequence] = {}
        self.draining = False

    def enter(self, seq: Sequence) -> None:
        """Admits seq; Unavailable once draining began. The caller calls `leave` when its request ends."""
        with self._changed:
            if self.draining:
                raise Unavailable(DRAINING)
            assert seq.seq_id not in self._running, "one admission per sequence"
            self._running[seq.seq_id] = seq

    def leave(self, seq_id: str) -> None:
        with self._changed:
            self._running.pop(seq_id, None)
            self._changed.notify_all()

    def running(self) -> int:
        with self._changed:
            return len(self._running)

    def running_requests(self, request_id: str, tenant: str) -> list[Sequence]:
        """The admitted requests of this id sent with this API key's name (first samples)."""
        with self._changed:
            return [s for s in self._running.values() if s.request_id == request_id and s.tenant == tenant]

    def drain(self, timeout: float) -> int:
        """Refuses new requests from now on and waits until the admitted ones end, for at most timeout
        seconds; then fails those still running with UNAVAILABLE. Returns how many it failed."""
        with self._changed:
            self.draining = True
            self._changed.wait_for(lambda: not self._running, timeout)
            left = list(self._running.values())
        for seq in left:
            seq.outbox.put(Unavailable(CUT))
        return len(left)
