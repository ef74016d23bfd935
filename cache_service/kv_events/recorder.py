"""The prefix index's changes as KV events, in order: a listener on the pool's prefix index (called under the
cache's lock) that the publisher's thread empties."""

import threading
from collections.abc import Sequence

from cache_service.kv_events import wire
from cache_service.prefix_cache import BlockHash, LoraTag, PrefixListener


class EventRecorder(PrefixListener):
    """Blocks indexed one after another on one chain join one BlockStored, evictions in a row one
    BlockRemoved (the format carries several hashes per event); `wake` is set whenever an event is added."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._events: list[wire.Event] = []

    def cached(
        self,
        block_id: int,
        hash_: BlockHash,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        lora: LoraTag | None = None,
    ) -> None:
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, wire.BlockStored) and parent is not None and last.block_hashes[-1] == parent:
                last.block_hashes.append(hash_)
                last.token_ids.extend(token_ids)
            else:
                self._events.append(wire.stored(hash_, parent, list(token_ids), self.block_size, lora))
        self.wake.set()

    def evicted(self, block_id: int, hash_: BlockHash) -> None:
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, wire.BlockRemoved):
                last.block_hashes.append(hash_)
            else:
                self._events.append(wire.removed(hash_))
        self.wake.set()

    def cleared(self) -> None:
        """Every block announced before is gone."""
        with self._lock:
            self._events.append(wire.AllBlocksCleared())
        self.wake.set()

    def take(self) -> list[wire.Event]:
        """The events recorded since the last take, oldest first (the recorder keeps none of them)."""
        with self._lock:
            events, self._events = self._events, []
        return events
