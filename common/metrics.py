"""One metrics helper for every service: the Prometheus HTTP endpoint and the bucket layouts they share.

Each service defines its own metrics (named `pagedserve_*`, documented in docs/operations.md) in the default
registry and calls `serve_metrics(host, port)`; port 0 leaves the endpoint off.
"""

from prometheus_client import start_http_server

# Latencies from 1 ms to 2 min: a CPU decode step is ~0.1 s, a long CPU prefill tens of seconds.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Tokens in one step: one decode token per sequence up to a full prefill budget.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def serve_metrics(host: str, port: int, log) -> None:
    """Serves the default registry as Prometheus text on http://host:port/metrics; port 0 is off.

    Raises OSError if the port is taken, so a misconfigured service fails at start-up, not silently.
    """
    if not port:
        return
    start_http_server(port, addr=host)
    log.info("metrics", url=f"http://{host}:{port}/metrics")
