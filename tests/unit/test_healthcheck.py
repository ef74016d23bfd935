"""common.healthcheck: the one grpc.health.v1 probe and its command line."""

import pytest
import structlog

from cli.launch import free_port
from common import healthcheck
from common.server import serve

SERVICE = "pagedserve.v1.Generation"


def test_status_and_serving_follow_the_server():
    server = serve([], "127.0.0.1", 0, structlog.get_logger())
    target = f"127.0.0.1:{server.port}"
    try:
        assert healthcheck.status(target) == "SERVING" and healthcheck.serving(target)
        assert healthcheck.status(target, SERVICE) == "NOT_FOUND" and not healthcheck.serving(target, SERVICE)
        server.set_serving(SERVICE, True)
        assert healthcheck.serving(target, SERVICE)
        server.set_serving("", False)
        assert healthcheck.status(target) == "NOT_SERVING" and not healthcheck.serving(target)
        assert healthcheck.main([target, SERVICE]) == 0 and healthcheck.main([target]) == 1
    finally:
        server.stop(0)
    dead = f"127.0.0.1:{free_port()}"
    assert healthcheck.status(dead) == "UNAVAILABLE" and not healthcheck.serving(dead)
    assert healthcheck.main([dead]) == 1
    with pytest.raises(SystemExit) as usage:
        healthcheck.main([])
    assert usage.value.code == 2
