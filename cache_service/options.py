"""The cache service's flags, for `python -m cache_service` and `pagedserve up`."""

import argparse

from cache_service.allocators import registry
from cache_service.kv_events.options import add_kv_events
from cache_service.tiers.options import add_tier_settings
from cache_service.units import parse_size, positive_int, size_or_zero
from common.options import ServiceOptions, add_kv_device, add_logging, positive_seconds
from common.transport import add_listen

DEFAULT_KV_MEMORY = 256 * 2**20
DEFAULT_IMAGE_STORE_MEMORY = 128 * 2**20
# The TTL of a session opened with ttl_s 0 (capped at --max-session-ttl).
DEFAULT_SESSION_TTL_S = 10.0


def add_settings(parser: argparse.ArgumentParser) -> None:
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--kv-blocks", type=positive_int, help="default pool size in blocks")
    budget.add_argument(
        "--kv-memory", type=parse_size, help="default pool size in bytes, e.g. 512MiB, 2GiB (default: 256MiB)"
    )
    parser.add_argument(
        "--allocator",
        default="freelist",
        help=f"one of {', '.join(registry.available())}, or package.module:Class (default: freelist)",
    )
    parser.add_argument(
        "--no-prefix-cache", dest="prefix_cache", action="store_false", help="never share cached blocks"
    )
    parser.add_argument(
        "--max-session-ttl",
        type=positive_seconds,
        default=60.0,
        help="longest TTL a session may ask for, seconds; a session not renewed within its TTL lapses and "
        f"its sequences are freed (default TTL: {DEFAULT_SESSION_TTL_S:g} s, or this if smaller)",
    )
    parser.add_argument(
        "--image-store-memory",
        type=size_or_zero,
        default=DEFAULT_IMAGE_STORE_MEMORY,
        help="bytes of a vision-language model's image store, the image embeddings kept beside the pool, "
        "e.g. 256MiB (default: 128MiB; 0: none; docs/vision.md#image-store)",
    )
    parser.add_argument(
        "--debug-read-kv",
        action="store_true",
        help="let ReadBlock return raw K/V bytes (include_data): other requests' prompts; debugging only",
    )


OPTIONS = ServiceOptions(
    "cache_service",
    50052,
    settings=(add_kv_device, add_settings, add_tier_settings, add_kv_events, add_logging),
    wiring=(add_listen,),
)
