"""The shared remote tier: records in a Redis (or Redis-compatible) server that several stacks may share.

The location is a URL, `redis://[:PASSWORD@]HOST:PORT/DB` (`rediss://` for TLS), whose query may set the
tier's own settings (docs/kv-tiers.md): `timeout` (seconds per operation, default 0.2), `ttl` (seconds a
record lives after its last store or load, default 86400), `max_entry` (largest record stored, default
32MiB), `prefix` (of every key, default `pagedserve:`, so stacks of different deployments can share a
server without sharing blocks). Redis itself evicts (its `maxmemory` and policy): the budget here bounds
only the local index (`contains`, `usage`), which mirrors what this process stored or loaded.
"""

import argparse
import threading
import time
from collections import OrderedDict
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cache_service.tiers.base import KVTier, TierError, TierUsage
from cache_service.units import parse_size

SETTINGS = {"timeout": 0.2, "ttl": 86400, "max_entry": 32 * 2**20, "prefix": "pagedserve:"}
# NOTE: after a failed operation the tier refuses at once for this long, so a Redis that is down costs the
# cache's lock no timeout per block; the first operation after it tries the server again.
RETRY_AFTER_S = 1.0


def parse_location(location: str) -> tuple[str, dict]:
    """The server's URL (without the tier's settings) and the settings; TierError if one is invalid."""
    parts = urlsplit(location)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise TierError(f"expected a redis://HOST:PORT/DB URL, got {location!r}")
    query, settings = [], dict(SETTINGS)
    for name, value in parse_qsl(parts.query):
        if name not in SETTINGS:
            query.append((name, value))
            continue
        try:
            settings[name] = _parse_setting(name, value)
        except (ValueError, argparse.ArgumentTypeError) as err:
            raise TierError(f"invalid {name}={value!r} in the Redis tier URL: {err}") from err
    return urlunsplit(parts._replace(query=urlencode(query))), settings


def _parse_setting(name: str, value: str) -> float | int | str:
    if name == "prefix":
        return value
    number = parse_size(value) if name == "max_entry" else float(value)
    if number <= 0:
        raise ValueError("must be > 0")
    return int(number) if name in ("ttl", "max_entry") else number


def redact(url: str) -> str:
    """The URL without its password (it is shown in GetStats and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else ""
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


class RedisTier(KVTier):
    """Every operation is one command bounded by `timeout`; any Redis error becomes TierError. Records expire
    `ttl` seconds after their last store or load. `contains` answers from the local index only (what this
    process stored or loaded): `load` asks the server, so blocks another stack stored are found."""

    name = "redis"

    def __init__(self, location: str, budget_bytes: int) -> None:
        url, settings = parse_location(location)
        super().__init__(redact(url), budget_bytes)
        self.timeout, self.ttl = settings["timeout"], settings["ttl"]
        self.max_entry = min(settings["max_entry"], budget_bytes)
        self._prefix = settings["prefix"].encode()
        try:
            self._redis = redis.Redis.from_url(
                url,
                socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
                retry=Retry(NoBackoff(), 0),  # NOTE: no retry: a failure falls back to recomputing at once
            )
        except ValueError as err:
            raise TierError(f"invalid Redis tier URL {self.location}: {err}") from err
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> record bytes, least recently used first
        self._bytes = 0
        self._evictions = 0
        self._down_until = 0.0
        self._call("ping")

    def store(self, key: bytes, record: bytes) -> None:
        if len(record) > self.max_entry:
            raise TierError(
                f"a record of {len(record)} bytes is over the Redis tier's entry cap ({self.max_entry})"
            )
        self._call("set", self._prefix + key, record, ex=self.ttl)
        self._remember(key, len(record))

    def load(self, key: bytes) -> bytes | None:
        record = self._call("getex", self._prefix + key, ex=self.ttl)
        if record is None:
            self._forget(key)
            return None
        self._remember(key, len(record))
        return record

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def delete(self, key: bytes) -> None:
        self._forget(key)
        self._call("delete", self._prefix + key)

    def usage(self) -> TierUsage:
        """The local index's figures (no server round trip): records this process stored or loaded lately."""
        with self._lock:
            return TierUsage(len(self._index), self._bytes, self.budget_bytes, self._evictions)

    def close(self) -> None:
        self._redis.close()

    def _call(self, command: str, *args, **kwargs):
        """One Redis command; TierError on any Redis error or timeout, and at once while the server is
        deemed down (for RETRY_AFTER_S after a failure)."""
        if time.monotonic() < self._down_until:
            raise TierError(f"Redis tier {self.location} is unreachable (retrying after {RETRY_AFTER_S}s)")
        try:
            return getattr(self._redis, command)(*args, **kwargs)
        except redis.RedisError as err:
            self._down_until = time.monotonic() + RETRY_AFTER_S
            raise TierError(f"Redis tier {self.location}: {command} failed: {err}") from err

    def _remember(self, key: bytes, size: int) -> None:
        with self._lock:
            self._bytes += size - self._index.pop(key, 0)
            self._index[key] = size
            while self._bytes > self.budget_bytes:
                self._bytes -= self._index.popitem(last=False)[1]
                self._evictions += 1

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._bytes -= self._index.pop(key, 0)
