"""The tier contract: a byte store of records under keys, with a budget. What a record holds and how it is
checked (record.py) and when blocks are written or loaded (manager.py) are the same for every tier."""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


class TierError(Exception):
    """A tier operation failed (I/O error, remote unreachable, timeout): the caller counts it and goes on
    without the tier for that block (the block is computed again), never failing the request."""


@dataclass(frozen=True, slots=True)
class TierUsage:
    records: int
    bytes: int
    budget_bytes: int
    evictions: int  # records dropped to stay within the budget


class KVTier(ABC):
    """Records (opaque bytes) under keys (opaque bytes), at most `budget_bytes` of them in all, the least
    recently used dropped first. `store` runs on the tier's writer thread; `load`, `contains` and `delete`
    on the thread serving a Reserve, under the cache's lock: a tier makes them safe together, and makes
    `contains` cheap (a local index; it may be stale, a later `load` may still miss). A remote tier bounds
    every operation by a timeout and raises TierError past it."""

    name: ClassVar[str]

    def __init__(self, location: str, budget_bytes: int) -> None:
        """Opens (or creates) the store at `location` (a directory, a URL); TierError if it cannot."""
        assert budget_bytes > 0, budget_bytes
        self.location = location
        self.budget_bytes = budget_bytes

    @abstractmethod
    def store(self, key: bytes, record: bytes) -> None:
        """Keeps record under key (replacing one there), dropping least recently used records to stay
        within the budget; a record larger than the budget is not kept."""

    @abstractmethod
    def load(self, key: bytes) -> bytes | None:
        """The record under key (now the most recently used), or None."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether a record is held under key, from a local index (the manager skips writing a block held
        already); a shared tier's index knows only this process's records, so `load` is asked regardless."""

    @abstractmethod
    def delete(self, key: bytes) -> None:
        """Drops the record under key, if any (a corrupt one)."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    @abstractmethod
    def close(self) -> None:
        """Releases the store (written records stay)."""
