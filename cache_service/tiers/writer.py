"""The tier's writer: one background thread storing block copies, so no RPC waits for a tier write."""

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cache_service.tiers import record
from cache_service.tiers.base import KVTier, TierError


@dataclass(slots=True)
class WriteCounters:
    written_blocks: int = 0
    written_bytes: int = 0
    drops: int = 0  # blocks not written: the queue was full
    errors: int = 0  # stores the tier failed


class TierWriter:
    """A queue of (key, block bytes), at most `capacity` bytes, and the thread that encodes and stores them in
    order. `offer` never blocks: with the queue full the block is dropped (counted), to be offered again on
    its next hit or its eviction. A key is queued at most once at a time."""

    def __init__(self, tier: KVTier, capacity: int, on_error: Callable[[str], None]) -> None:
        assert capacity > 0, capacity
        self.counters = WriteCounters()
        self.capacity = capacity
        self._tier = tier
        self._on_error = on_error
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: set[bytes] = set()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def is_pending(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pending

    def has_room(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit in the queue now; counts a drop if not (checked before a block is
        copied out of the pool)."""
        with self._lock:
            if self._queued_bytes + nbytes <= self.capacity:
                return True
            self.counters.drops += 1
            return False

    def offer(self, key: bytes, data: np.ndarray) -> None:
        """Queues a copy of a block's bytes (a C-ordered uint8 array no one else holds) to be stored under
        key; the caller checked `has_room` (only it adds to the queue)."""
        with self._lock:
            if key in self._pending:
                return
            self._pending.add(key)
            self._queued_bytes += data.nbytes
        self._queue.put((key, data))

    def close(self, timeout: float) -> bool:
        """Stores what is queued (waiting at most `timeout` seconds), then stops the thread; returns whether
        it stopped (every queued block stored or failed)."""
        self._queue.put((None, None))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def store(self, key: bytes, data: np.ndarray) -> bool:
        """Encodes and stores one block copy now, on the calling thread, counted as the thread's writes are;
        returns whether it was stored. Only once `close` returned True (no two stores at once)."""
        assert not self._thread.is_alive(), "the writer thread still stores"
        return self._store(key, data)

    def _run(self) -> None:
        while True:
            key, data = self._queue.get()
            if key is None:
                return
            try:
                self._store(key, data)
            finally:
                with self._lock:
                    self._pending.discard(key)
                    self._queued_bytes -= data.nbytes

    def _store(self, key: bytes, data: np.ndarray) -> bool:
        payload = memoryview(data.reshape(-1))
        try:
            self._tier.store(key, record.encode(payload))
        except TierError as err:
            with self._lock:
                self.counters.errors += 1
            self._on_error(str(err))
            return False
        with self._lock:
            self.counters.written_blocks += 1
            self.counters.written_bytes += len(payload)
        return True
