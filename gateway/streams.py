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
