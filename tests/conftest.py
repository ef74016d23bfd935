"""Fixtures shared by unit and end-to-end tests."""

import pytest
import torch

from common import cpu
from tests.redis_server import RedisServer


def pytest_report_header() -> list[str]:
    """The machine at the head of every run, so that a failure names it (docs/testing.md)."""
    vector = sorted(flag for flag in cpu.cpu_flags() if flag.startswith(("sse", "avx", "amx", "fma", "f16c")))
    return [f"cpu: {cpu.describe()}", f"cpu vector flags: {' '.join(vector)}"]


# The modules that take minutes (`--durations`), run first: `make test` hands whole modules to two workers in
# collection order, so the long ones overlap the many short ones instead of ending the run alone.
SLOW_FIRST = (
    "tests/e2e/test_installed_wheel.py",
    "tests/e2e/test_generation.py",
    "tests/e2e/test_chaos.py",
    "tests/e2e/test_kv_dtype_quality.py",
    "tests/e2e/test_bench.py",
    "tests/e2e/test_scheduling.py",
    "tests/e2e/test_prefix_cache.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))


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
