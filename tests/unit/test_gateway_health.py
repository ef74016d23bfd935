"""The gateway is SERVING only while both downstream services answer SERVING."""

import structlog
from grpc_health.v1 import health_pb2

from common.server import serve
from gateway.health import DownstreamWatcher
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
