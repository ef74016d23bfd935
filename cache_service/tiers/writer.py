"""The tier's writer: one background thread storing block copies, so no RPC waits for a tier write."""

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cache_service.tiers import record
from cache_service.tiers.base import KVTier, TierError


@dataclass(slots=True)
class WriteCounters:
    written_blocks: int = 0
    written_bytes: int = 0
    drops: int = 0  # blocks not written: the queue was full
    errors: int = 0  # stores the tier failed


class TierWriter:
    """A bounded queue of (key, block bytes) and the thread that encodes and stores them in order.
    `offer` never blocks: with the queue full the block is dropped (counted), to be offered again on its next
    hit or its eviction. A key is queued at most once at a time."""

    def __init__(self, tier: KVTier, capacity: int, on_error: Callable[[str], None]) -> None:
        assert capacity > 0, capacity
        self.counters = WriteCounters()
        self._tier = tier
        self._on_error = on_error
        self._queue: queue.Queue = queue.Queue(capacity)
        self._pending: set[bytes] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def is_pending(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pending

    def has_room(self) -> bool:
        """Whether an `offer` now would be queued (checked before copying a block out of the pool)."""
        if self._queue.full():
            with self._lock:
                self.counters.drops += 1
            return False
        return True

    def offer(self, key: bytes, data: torch.Tensor) -> None:
        """Queues a copy of a block's bytes (a uint8 tensor no one else holds) to be stored under key."""
        with self._lock:
            if key in self._pending:
                return
            try:
                self._queue.put_nowait((key, data))
            except queue.Full:
                self.counters.drops += 1
                return
            self._pending.add(key)

    def close(self, timeout: float) -> None:
        """Stores what is queued (waiting at most `timeout` seconds), then stops the thread."""
        try:
            self._queue.put((None, None), timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            key, data = self._queue.get()
            if key is None:
                return
            payload = data.numpy().tobytes()
            try:
                self._tier.store(key, record.encode(payload))
            except TierError as err:
                with self._lock:
                    self.counters.errors += 1
                self._on_error(str(err))
            else:
                with self._lock:
                    self.counters.written_blocks += 1
                    self.counters.written_bytes += len(payload)
            finally:
                with self._lock:
                    self._pending.discard(key)
