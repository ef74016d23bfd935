"""The one reader of the services' Prometheus /metrics: every sample, keyed by its name and labels."""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# (sample name, its labels as sorted (name, value) pairs) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of Prometheus text (histograms as their _bucket, _sum and _count samples)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(url: str, timeout: float = 10.0) -> Samples:
    """Every sample one /metrics endpoint serves now; URLError or OSError when it cannot be read."""
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return parse(reply.read().decode())
