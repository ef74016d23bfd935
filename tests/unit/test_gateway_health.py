"""The gateway is SERVING only while both downstream services answer SERVING."""

import time

import pytest
import structlog
from grpc_health.v1 import health_pb2

from common.server import serve
from gateway.health import DownstreamWatcher
from protos import cache_pb2, cache_pb2_grpc
from tests.helpers import free_port

SERVICE = "pagedserve.v1.Generation"


def _status(server) -> int:
    return server.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), None).status


def test_watcher_flips_with_downstream_health():
    log = structlog.get_logger()
    gateway, cache = serve([], "127.0.0.1", 0, log), serve([], "127.0.0.1", 0, log)
    dead = f"127.0.0.1:{free_port()}"
    try:
        watcher = DownstreamWatcher(gateway, SERVICE, {"cache": f"127.0.0.1:{cache.port}", "compute": dead})
        assert watcher.down() == ["compute"]
        watcher.stop()
        watcher.run()
        assert _status(gateway) == health_pb2.HealthCheckResponse.NOT_SERVING
        watcher = DownstreamWatcher(
            gateway, SERVICE, {"cache": f"127.0.0.1:{cache.port}", "compute": f"127.0.0.1:{cache.port}"}
        )
        watcher.stop()
        watcher.run()
        assert _status(gateway) == health_pb2.HealthCheckResponse.SERVING
        cache.set_serving("", False)
        assert watcher.down() == ["cache", "compute"]
    finally:
        gateway.stop(0)
        cache.stop(0)


class EpochCache(cache_pb2_grpc.CacheServicer):
    def __init__(self, epoch: str) -> None:
        self.epoch = epoch

    def GetStats(self, request, context):
        return cache_pb2.CacheStats(pool_epoch=self.epoch)


@pytest.fixture
def epoch_cache():
    """(a gateway's server, a cache's serving GetStats of pool e1, that EpochCache), stopped at teardown."""
    log, stats = structlog.get_logger(), EpochCache("e1")
    cache = serve(
        [(cache_pb2_grpc.add_CacheServicer_to_server, stats, "pagedserve.v1.Cache")], "127.0.0.1", 0, log
    )
    gateway = serve([], "127.0.0.1", 0, log)
    yield gateway, cache, stats
    gateway.stop(0)
    cache.stop(0)


def test_serving_needs_the_attached_pool_to_be_the_caches_and_a_restart_is_reported(epoch_cache):
    gateway, cache, stats = epoch_cache
    log = structlog.get_logger()
    target = f"127.0.0.1:{cache.port}"
    attached, restarts = ["e1"], []
    watcher = DownstreamWatcher(
        gateway,
        SERVICE,
        {"cache": target, "compute": target},
        lambda: attached[0],
        lambda name, _: restarts.append(name),
    )
    watcher.check()
    assert _status(gateway) == health_pb2.HealthCheckResponse.SERVING and restarts == []
    stats.epoch = "e2"
    watcher.check()
    assert _status(gateway) == health_pb2.HealthCheckResponse.NOT_SERVING and restarts == ["cache"]
    attached[0] = None
    assert watcher.stale_pool() == "no pool attached"
    attached[0] = "e2"
    watcher.check()
    assert _status(gateway) == health_pb2.HealthCheckResponse.SERVING
    cache.stop(0)
    assert watcher.down() == ["cache", "compute"]
    restarted = serve(
        [(cache_pb2_grpc.add_CacheServicer_to_server, stats, "pagedserve.v1.Cache")],
        "127.0.0.1",
        cache.port,
        log,
    )
    try:
        assert watcher.down() == []
        assert sorted(restarts) == ["cache", "cache", "compute"], "both names answered again"
    finally:
        restarted.stop(0)


def test_a_stale_pool_is_reported_as_seen_before_the_attached_epoch_was_read(epoch_cache):
    gateway, cache, stats = epoch_cache
    stats.epoch = "e2"
    read_at, restarts = [], []

    def attached_epoch() -> str:
        read_at.append(time.monotonic())
        return "e1"  # read just before the engine attached e2: the engine must not attach again for it

    watcher = DownstreamWatcher(
        gateway,
        SERVICE,
        {"cache": f"127.0.0.1:{cache.port}"},
        attached_epoch,
        lambda name, at: restarts.append((name, at)),
    )
    assert watcher.stale_pool() is not None
    ((name, seen_at),) = restarts
    assert name == "cache" and seen_at <= read_at[0], "an attach after the read may be to e2"
