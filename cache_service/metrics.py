"""The cache service's Prometheus metrics, read from its GetStats reply at scrape time (never stale)."""

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from protos import cache_pb2

# CacheStats counter fields and the metric each one is exported as.
COUNTERS = {
    "prefix_query_tokens": ("pagedserve_prefix_cache_queries", "Prompt tokens looked up in the prefix."),
    "prefix_hit_tokens": ("pagedserve_prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "copy_on_writes": (
        "pagedserve_kv_cow_copies",
        "Blocks copied on write before a shared block was written.",
    ),
    "evictions": ("pagedserve_kv_evictions", "Cached blocks evicted to make room for new ones."),
}
# TierStats fields (docs/kv-tiers.md), exported only when the service has a tier.
TIER_COUNTERS = {
    "hit_blocks": "Blocks loaded into the pool from the KV tier.",
    "miss_blocks": "Blocks looked up in the KV tier and not held.",
    "loaded_bytes": "Bytes loaded from the KV tier.",
    "load_seconds": "Seconds spent loading blocks from the KV tier.",
    "written_blocks": "Blocks written to the KV tier.",
    "written_bytes": "Bytes written to the KV tier.",
    "write_drops": "Blocks not written to the KV tier: its write queue was full.",
    "corrupt_records": "KV tier records found corrupt (skipped, deleted, never served).",
    "errors": "KV tier operations that failed.",
    "evictions": "KV tier records dropped to stay within its budget.",
}
TIER_GAUGES = {
    "stored_blocks": "Blocks the KV tier holds.",
    "stored_bytes": "Bytes the KV tier holds.",
    "queued_blocks": "Blocks waiting to be written to the KV tier.",
}

# ImageStoreStats fields (docs/vision.md#image-store), exported only when the pool has an image store.
IMAGE_STORE_COUNTERS = {
    "hits": "Image leases that found the image's embeddings in the store (the encoder skipped).",
    "misses": "Image leases that did not find them (encoded by compute).",
    "evictions": "Images dropped from the store, least recently used first, to make room.",
    "not_stored": "Images given no room in the store: larger than it, or it is full of images in use.",
}
IMAGE_STORE_GAUGES = {
    "capacity_bytes": "Bytes of the image store (--image-store-memory).",
    "stored_bytes": "Bytes of the embeddings the image store holds.",
    "stored_images": "Images whose embeddings the image store holds.",
    "leased_images": "Images of the store a step reads or writes now.",
}


class StatsCollector(Collector):
    """Turns one CacheStats snapshot per scrape into gauges and counters."""

    def __init__(self, get_stats: Callable[[], cache_pb2.CacheStats]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterator:
        stats = self._get_stats()
        yield GaugeMetricFamily(
            "pagedserve_kv_cache_usage_ratio", "Used KV blocks / total KV blocks (0 to 1).", stats.usage
        )
        blocks = GaugeMetricFamily("pagedserve_kv_blocks", "KV blocks by state.", labels=["state"])
        for state in ("used", "free", "cached"):
            blocks.add_metric([state], getattr(stats, f"{state}_blocks"))
        yield blocks
        pool = GaugeMetricFamily(
            "pagedserve_kv_pool_info", "1 for the pool's KV dtype and device.", labels=["kv_dtype", "device"]
        )
        if stats.kv_dtype:
            pool.add_metric([stats.kv_dtype, stats.device], 1)
        yield pool
        yield GaugeMetricFamily(
            "pagedserve_kv_sequences", "Sequences holding a block table.", stats.num_sequences
        )
        yield GaugeMetricFamily(
            "pagedserve_cache_sessions", "Sessions (gateway leases) open.", stats.num_sessions
        )
        yield GaugeMetricFamily(
            "pagedserve_kv_token_utilisation_ratio",
            "Tokens stored / token slots of the blocks held by tables (1 when no table is held).",
            stats.stored_tokens / stats.table_slots if stats.table_slots else 1.0,
        )
        for field_name, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, getattr(stats, field_name))
        if stats.HasField("kv_tier"):
            for field_name, doc in TIER_COUNTERS.items():
                yield CounterMetricFamily(
                    f"pagedserve_kv_tier_{field_name}", doc, getattr(stats.kv_tier, field_name)
                )
            for field_name, doc in TIER_GAUGES.items():
                yield GaugeMetricFamily(
                    f"pagedserve_kv_tier_{field_name}", doc, getattr(stats.kv_tier, field_name)
                )
        if stats.HasField("image_store"):
            for field_name, doc in IMAGE_STORE_COUNTERS.items():
                yield CounterMetricFamily(
                    f"pagedserve_image_store_{field_name}", doc, getattr(stats.image_store, field_name)
                )
            for field_name, doc in IMAGE_STORE_GAUGES.items():
                yield GaugeMetricFamily(
                    f"pagedserve_image_store_{field_name}", doc, getattr(stats.image_store, field_name)
                )


def register(get_stats: Callable[[], cache_pb2.CacheStats]) -> None:
    REGISTRY.register(StatsCollector(get_stats))
