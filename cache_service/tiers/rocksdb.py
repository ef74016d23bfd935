"""The local disk tier: records in RocksDB (rocksdict), the least recently used dropped past the budget.

Each record is two keys written in one atomic batch: b"d" + key (the record) and b"m" + key (its size and
use sequence number), so opening the database reads only the small b"m" entries to rebuild the LRU order.
"""

import struct
import threading
from collections import OrderedDict
from pathlib import Path

from rocksdict import Options, Rdict, WriteBatch

from cache_service.tiers.base import KVTier, TierError, TierUsage

DATA, META = b"d", b"m"
META_VALUE = struct.Struct("<QQ")  # record bytes, use sequence number


class RocksDBTier(KVTier):
    """One process at a time: RocksDB locks the directory (a second cache on it fails to start)."""

    name = "rocksdb"

    def __init__(self, location: str, budget_bytes: int) -> None:
        super().__init__(location, budget_bytes)
        try:
            # NOTE: 0700: the records are K/V of other requests' prompts.
            Path(location).mkdir(mode=0o700, parents=True, exist_ok=True)
            self._db = Rdict(location, Options(raw_mode=True))
        except Exception as err:  # rocksdict raises plain Exception for I/O and lock errors
            raise TierError(f"cannot open the RocksDB tier at {location}: {err}") from err
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> record bytes, least recently used first
        self._bytes = 0
        self._seq = 0
        self._evictions = 0
        self._read_index()

    def _read_index(self) -> None:
        entries = []
        for meta_key, value in self._db.items(from_key=META):
            if not meta_key.startswith(META):
                break
            if len(value) == META_VALUE.size:
                size, seq = META_VALUE.unpack(value)
                entries.append((seq, meta_key[1:], size))
        for seq, key, size in sorted(entries):
            self._lru[key] = size
            self._bytes += size
            self._seq = seq + 1
        with self._lock:
            self._shrink(self.budget_bytes)

    def store(self, key: bytes, record: bytes) -> None:
        if len(record) > self.budget_bytes:
            return
        with self._lock:
            self._drop(key)
            self._shrink(self.budget_bytes - len(record))
            batch = WriteBatch(raw_mode=True)
            batch.put(DATA + key, record)
            batch.put(META + key, META_VALUE.pack(len(record), self._seq))
            self._write(batch)
            self._lru[key] = len(record)
            self._bytes += len(record)
            self._seq += 1

    def load(self, key: bytes) -> bytes | None:
        with self._lock:
            if key not in self._lru:
                return None
            try:
                record = self._db.get(DATA + key)
                self._db.put(META + key, META_VALUE.pack(self._lru[key], self._seq))
            except Exception as err:
                raise TierError(f"RocksDB tier read failed: {err}") from err
            self._seq += 1
            if record is None:
                self._drop(key)
                return None
            self._lru.move_to_end(key)
            return record

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._lru

    def delete(self, key: bytes) -> None:
        with self._lock:
            self._drop(key)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._lru), self._bytes, self.budget_bytes, self._evictions)

    def close(self) -> None:
        """Syncs the write-ahead log to disk, so every record stored survives a power loss from now on,
        then closes the database."""
        with self._lock:
            try:
                self._db.flush_wal(True)
            finally:
                self._db.close()

    def _shrink(self, limit: int) -> None:
        """Drops least recently used records until at most `limit` bytes are held (lock held)."""
        while self._bytes > limit:
            self._drop(next(iter(self._lru)))
            self._evictions += 1

    def _drop(self, key: bytes) -> None:
        """Deletes the record under key, if indexed (lock held)."""
        if key not in self._lru:
            return
        batch = WriteBatch(raw_mode=True)
        batch.delete(DATA + key)
        batch.delete(META + key)
        self._write(batch)
        self._bytes -= self._lru.pop(key)

    def _write(self, batch: WriteBatch) -> None:
        try:
            self._db.write(batch)
        except Exception as err:
            raise TierError(f"RocksDB tier write failed: {err}") from err
