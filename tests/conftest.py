"""Fixtures shared by unit and end-to-end tests."""

import pytest
import torch

from common import cpu
from tests.redis_server import RedisServer


def pytest_report_header() -> list[str]:
    """The machine at the head of every run, so that a failure names it (docs/testing.md)."""
    vector = sorted(flag for flag in cpu.cpu_flags() if flag.startswith(("sse", "avx", "amx", "fma", "f16c")))
    return [f"cpu: {cpu.describe()}", f"cpu vector flags: {' '.join(vector)}"]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server on a free 127.0.0.1 port, nothing saved, stopped after the module."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def torch_threads():
    """Restores torch's thread count after a test that sets its own."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)
