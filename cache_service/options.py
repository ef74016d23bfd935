"""The cache service's flags, for `python -m cache_service` and `pagedserve up`."""

import argparse
import re
from fractions import Fraction

from cache_service.allocators import registry
from common.options import ServiceOptions, add_logging, positive_seconds
from common.transport import add_listen

DEFAULT_KV_MEMORY = 256 * 2**20
# The TTL of a session opened with ttl_s 0 (capped at --max-session-ttl).
DEFAULT_SESSION_TTL_S = 10.0
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '2GiB', '1GB', '1.5 GiB' (KB/MB/GB are powers of 1000)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: give bytes or e.g. 512MiB, 2GiB, 1GB")
    size = int(Fraction(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return size


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def add_settings(parser: argparse.ArgumentParser) -> None:
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--kv-blocks", type=_positive_int, help="default pool size in blocks")
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
        "--debug-read-kv",
        action="store_true",
        help="let ReadBlock return raw K/V bytes (include_data): other requests' prompts; debugging only",
    )


OPTIONS = ServiceOptions("cache_service", 50052, settings=(add_settings, add_logging), wiring=(add_listen,))
