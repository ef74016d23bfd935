"""Where `pagedserve up --metrics-port BASE` serves each service's Prometheus /metrics: BASE (gateway),
BASE+1 (cache), BASE+2 (compute)."""

SERVICES = ("gateway", "cache", "compute")


def metrics_port(base: int, service: str) -> int:
    return base + SERVICES.index(service)
