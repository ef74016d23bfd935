"""A cap on concurrent Generate streams below the server's thread pool, so that threads always remain for
health checks and GetInfo: a stream holds a server thread from its start to its end."""

import contextlib
import threading
from collections.abc import Iterator

from common.errors import ResourceExhausted

# Server threads kept free of streams: health, reflection, GetInfo.
SPARE_THREADS = 8


class StreamSlots:
    def __init__(self, limit: int) -> None:
        assert limit > 0, limit
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)

    @property
    def server_threads(self) -> int:
        """The thread pool the gateway's server needs: every stream plus the spare threads."""
        return self.limit + SPARE_THREADS

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """One slot for the duration of a stream; refused at once (RESOURCE_EXHAUSTED) when none is free."""
        if not self._free.acquire(blocking=False):
            raise ResourceExhausted(f"too many concurrent streams ({self.limit}); retry")
        try:
            yield
        finally:
            self._free.release()


class KeySlots:
    """A cap on each API key's concurrent Generate streams (beside the global StreamSlots)."""

    def __init__(self, limit: int) -> None:
        assert limit > 0, limit
        self.limit = limit
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, key_name: str) -> Iterator[None]:
        """One of key_name's slots for the duration of a stream; RESOURCE_EXHAUSTED at once when it has
        none free."""
        with self._lock:
            held = self._held.get(key_name, 0)
            if held >= self.limit:
                raise ResourceExhausted(
                    f"API key {key_name!r} has {held} streams open; the limit is {self.limit} "
                    "(--max-streams-per-key): retry when one ends"
                )
            self._held[key_name] = held + 1
        try:
            yield
        finally:
            with self._lock:
                self._held[key_name] -= 1
                if not self._held[key_name]:
                    del self._held[key_name]
