"""Tiers by name, so `--kv-tier NAME` picks one at start-up: `none` (no tier), a built-in (`rocksdb`,
`redis`), an entry point in the group `pagedserve.kv_tiers`, or `package.module:Class` naming a KVTier
subclass (cache_service/plugins.py, as for allocators)."""

from cache_service.plugins import Plugins
from cache_service.tiers.base import KVTier
from cache_service.tiers.redis import RedisTier
from cache_service.tiers.rocksdb import RocksDBTier

NONE = "none"
PLUGINS = Plugins(
    "KV tier", KVTier, "pagedserve.kv_tiers", {cls.name: cls for cls in (RocksDBTier, RedisTier)}
)


def available() -> list[str]:
    """`none`, then the built-in and entry-point names (dotted paths are accepted too, but not listed)."""
    return [NONE, *PLUGINS.available()]


def resolve(name: str) -> type[KVTier] | None:
    """The tier class for `name` (None for `none`); InvalidArgument if it names none or not a KVTier."""
    return None if name == NONE else PLUGINS.resolve(name)
