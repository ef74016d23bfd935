"""cli.launch starts, waits for and stops servers; cli.scrape reads a /metrics endpoint."""

import socket
import sys

import pytest
import structlog
from prometheus_client import Counter

from cli import launch
from cli.scrape import scrape
from common.metrics import serve_metrics

SCRAPED = Counter("pagedserve_test_scraped", "A counter the scrape test reads.", ["kind"])


def test_free_ports_are_consecutive_and_bindable():
    base = launch.free_ports(3)
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for sock, port in zip((a, b, c), range(base, base + 3), strict=True):
            sock.bind(("127.0.0.1", port))


def test_free_ports_are_below_the_ephemeral_range_and_never_handed_out_twice():
    low = int(launch.EPHEMERAL_RANGE.read_text().split()[0])
    ports = [launch.free_port() for _ in range(200)] + [launch.free_ports(3) + i for i in range(3)]
    assert len(set(ports)) == len(ports)
    assert all(launch.LOWEST_PORT <= port < low for port in ports)


def test_wait_healthy_reports_an_exit_with_the_log_tail(tmp_path):
    proc = launch.spawn([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], tmp_path / "out.log")
    with pytest.raises(RuntimeError, match=r"exited with 3:\nboom"):
        launch.wait_healthy(f"127.0.0.1:{launch.free_port()}", proc, timeout=60)
    assert proc.log_path == tmp_path / "out.log"


def test_wait_healthy_times_out_and_stop_terminates():
    proc = launch.spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(TimeoutError, match="output discarded"):
            launch.wait_healthy(f"127.0.0.1:{launch.free_port()}", proc, timeout=0.5)
        assert proc.poll() is None, "a timeout leaves the process running"
    finally:
        assert launch.stop(proc) == -15


def test_scrape_reads_every_sample_by_name_and_labels():
    port = launch.free_port()
    serve_metrics("127.0.0.1", port, structlog.get_logger())
    SCRAPED.labels(kind="decode").inc(3)
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert samples["pagedserve_test_scraped_total", (("kind", "decode"),)] == 3.0
