"""Fixtures shared by unit and end-to-end tests."""

import pytest

from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server on a free 127.0.0.1 port, nothing saved, stopped after the module."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
