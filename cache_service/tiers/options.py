"""The KV tier's flags (cache service, forwarded by `pagedserve up`) and their defaults.

NOTE: the flags default to None so that an unset flag is told from one set to its default: the value is the
flag's if given, else the config file's, else DEFAULTS' (`resolve`), and `up` forwards only flags given.
"""

import argparse

from cache_service.tiers import config_file, registry
from cache_service.units import fraction, parse_size, positive_int, size_or_zero
from common.errors import InvalidArgument
from common.options import positive_seconds

DEFAULTS = {
    "kv_tier": registry.NONE,
    "kv_tier_path": None,
    "kv_tier_budget": 8 * 2**30,
    "kv_tier_hot": 0.8,
    "kv_tier_max_load": 256,
    "kv_tier_queue": 256 * 2**20,
    "kv_tier_flush": 2 * 2**30,
    "kv_tier_flush_timeout": 20.0,
}


def add_tier_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=config_file.load,
        help="YAML file with a `persistence:` section (enabled, storage_path, hot_blocks_threshold, tier, "
        "budget, max_load_blocks, write_queue, flush_on_stop, flush_timeout); flags win over it",
    )
    parser.add_argument(
        "--kv-tier",
        help=f"where prefix blocks outlive the pool: {', '.join(registry.available())}, or "
        "package.module:Class (default: none)",
    )
    parser.add_argument(
        "--kv-tier-path",
        help="the tier's storage: a directory for rocksdb, redis://HOST:PORT/DB?timeout=0.2&ttl=86400&"
        "max_entry=32MiB&prefix=pagedserve: for redis",
    )
    parser.add_argument("--kv-tier-budget", type=parse_size, help="the tier's size limit (default: 8GiB)")
    parser.add_argument(
        "--kv-tier-hot",
        type=fraction,
        help="hot_blocks_threshold: write a cached block once its prefix hits reach this fraction of the "
        "prefix lookups since it was cached; 0: every block once cached (default: 0.8)",
    )
    parser.add_argument(
        "--kv-tier-max-load",
        type=positive_int,
        help="most blocks one Reserve loads from the tier (default: 256)",
    )
    parser.add_argument(
        "--kv-tier-queue",
        type=parse_size,
        help="bytes of blocks waiting to be written, at most; more are dropped (default: 256MiB)",
    )
    parser.add_argument(
        "--kv-tier-flush",
        type=size_or_zero,
        help="on SIGTERM, write the prefix cache's blocks the tier lacks, most recently used first, up to "
        "this many bytes (0: only the queued writes) (default: 2GiB)",
    )
    parser.add_argument(
        "--kv-tier-flush-timeout",
        type=positive_seconds,
        help="seconds a stopping cache spends on the queued writes and that flush, at most (default: 20)",
    )


def setting(args: argparse.Namespace, dest: str) -> object:
    """One tier setting: the flag's value if given, else the config file's, else its default."""
    given = getattr(args, dest)
    if given is not None:
        return given
    return (args.config.settings if args.config else {}).get(dest, DEFAULTS[dest])


def resolve(args: argparse.Namespace) -> None:
    """Sets each tier setting left unset by the flags from the config file, else its default; ValueError
    (for parser.error) when the tier is unknown or has no path."""
    for dest in DEFAULTS:
        setattr(args, dest, setting(args, dest))
    try:
        registry.resolve(args.kv_tier)
    except InvalidArgument as err:
        raise ValueError(f"--kv-tier: {err}") from err
    if args.kv_tier != registry.NONE and not args.kv_tier_path:
        raise ValueError(f"--kv-tier {args.kv_tier} needs --kv-tier-path (or persistence.storage_path)")
