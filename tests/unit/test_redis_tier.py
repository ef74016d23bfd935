"""The Redis KV tier against a real redis-server on 127.0.0.1: records, TTLs, the entry cap, the key prefix,
and a stopped server turned into TierError within the timeout (then the tier resumes)."""

import signal
import time

import pytest

from cache_service.tiers import record, registry
from cache_service.tiers.base import TierError
from cache_service.tiers.redis import RETRY_AFTER_S, RedisTier, redact
from cli.launch import free_port


def rec(n: int, size: int = 100) -> bytes:
    return record.encode(bytes([n % 256]) * size)


def test_stores_loads_and_deletes_records_under_its_prefix_with_a_ttl(redis_server):
    tier = RedisTier(redis_server.url + "?ttl=300&prefix=stack-a:", 10_000)
    try:
        assert tier.load(b"k1") is None and not tier.contains(b"k1")
        tier.store(b"k1", rec(1))
        assert tier.contains(b"k1") and tier.load(b"k1") == rec(1)
        with redis_server.client() as client:
            assert client.get(b"stack-a:k1") == rec(1), "keys carry the prefix"
            assert 0 < client.ttl(b"stack-a:k1") <= 300
            client.expire(b"stack-a:k1", 5)
            assert tier.load(b"k1") == rec(1) and client.ttl(b"stack-a:k1") > 5, "a load renews the TTL"
        tier.delete(b"k1")
        assert tier.load(b"k1") is None and not tier.contains(b"k1")
        assert tier.usage().records == 0
    finally:
        tier.close()


def test_two_tiers_share_records_unless_their_prefixes_differ(redis_server):
    a, b, other = (RedisTier(redis_server.url + query, 10_000) for query in ("", "", "?prefix=elsewhere:"))
    try:
        a.store(b"shared", rec(2))
        assert not b.contains(b"shared"), "contains knows only this process's records"
        assert b.load(b"shared") == rec(2) and b.contains(b"shared"), "load asks the redis_server"
        assert other.load(b"shared") is None
    finally:
        for tier in (a, b, other):
            tier.close()


def test_a_record_over_the_entry_cap_is_refused(redis_server):
    tier = RedisTier(redis_server.url + "?max_entry=1KiB", 10_000)
    try:
        with pytest.raises(TierError, match="entry cap"):
            tier.store(b"big", rec(3, 2000))
        assert tier.load(b"big") is None
        tier.store(b"small", rec(3, 500))
        assert tier.load(b"small") == rec(3, 500)
    finally:
        tier.close()


def test_the_local_index_stays_within_the_budget_while_redis_keeps_the_records(redis_server):
    size = len(rec(0))
    tier = RedisTier(redis_server.url + "?prefix=budget:", 3 * size)
    try:
        for n in range(5):
            tier.store(bytes([n]), rec(n))
        usage = tier.usage()
        assert (usage.records, usage.bytes, usage.evictions) == (3, 3 * size, 2)
        assert not tier.contains(bytes([0])) and tier.load(bytes([0])) == rec(0), (
            "Redis evicts, not the index"
        )
    finally:
        tier.close()


def test_invalid_urls_and_settings_are_refused(redis_server):
    for location, message in [
        ("/var/lib/kv", "redis://"),
        (redis_server.url + "?timeout=0", "timeout"),
        (redis_server.url + "?max_entry=lots", "max_entry"),
    ]:
        with pytest.raises(TierError, match=message):
            RedisTier(location, 10_000)


def test_a_stopped_server_raises_tier_error_within_the_timeout_and_the_tier_resumes(redis_server):
    tier = RedisTier(redis_server.url + "?timeout=0.2", 10_000)
    try:
        tier.store(b"k", rec(4))
        redis_server.stop()
        for operation in (
            lambda: tier.load(b"k"),
            lambda: tier.store(b"k2", rec(5)),
            lambda: tier.delete(b"k"),
        ):
            started = time.monotonic()
            with pytest.raises(TierError):
                operation()
            assert time.monotonic() - started < 0.5
        redis_server.start()
        with pytest.raises(TierError, match="unreachable"):
            tier.load(b"k")  # refused at once until RETRY_AFTER_S has passed
        time.sleep(RETRY_AFTER_S)
        assert tier.load(b"k") is None, "the redis_server came back empty (nothing saved)"
        tier.store(b"k", rec(6))
        assert tier.load(b"k") == rec(6)
    finally:
        tier.close()


def test_an_unreachable_server_at_start_up_is_a_tier_error(redis_server):
    with pytest.raises(TierError, match="ping failed"):
        RedisTier(f"redis://127.0.0.1:{free_port()}/0?timeout=0.2", 10_000)


def test_the_registry_resolves_redis():
    assert "redis" in registry.available()
    assert registry.resolve("redis") is RedisTier


def test_a_hung_server_times_out_within_the_timeout(redis_server):
    tier = RedisTier(redis_server.url + "?timeout=0.2", 10_000)
    try:
        tier.store(b"k", rec(7))
        redis_server.proc.send_signal(signal.SIGSTOP)  # connected, never answering
        try:
            started = time.monotonic()
            with pytest.raises(TierError, match="load|getex|Timeout"):
                tier.load(b"k")
            assert 0.15 < time.monotonic() - started < 0.6
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        time.sleep(RETRY_AFTER_S)
        assert tier.load(b"k") == rec(7), "resumed on a new connection"
    finally:
        tier.close()


def test_the_password_is_not_shown():
    assert redact("redis://:secret@10.0.0.5:6380/1?ttl=60") == "redis://***@10.0.0.5:6380/1?ttl=60"
    assert redact("redis://10.0.0.5/0") == "redis://10.0.0.5/0"
