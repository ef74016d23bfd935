"""Tiers by name, so `--kv-tier NAME` picks one at start-up (as allocators/registry.py picks allocators).

A name is `none` (no tier), a built-in (`rocksdb`), an entry point in the group `pagedserve.kv_tiers` of any
installed distribution, or a dotted path `package.module:Class` naming a KVTier subclass.
"""

import importlib
from importlib import metadata

from cache_service.tiers.base import KVTier
from cache_service.tiers.rocksdb import RocksDBTier
from common.errors import InvalidArgument

NONE = "none"
ENTRY_POINT_GROUP = "pagedserve.kv_tiers"
BUILTIN: dict[str, type[KVTier]] = {cls.name: cls for cls in (RocksDBTier,)}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available() -> list[str]:
    """`none`, built-in and entry-point names (dotted paths are accepted too, but not listed)."""
    return [NONE, *sorted(BUILTIN.keys() | _entry_points().keys())]


def resolve(name: str) -> type[KVTier] | None:
    """The tier class for `name` (None for `none`); InvalidArgument if it names none or not a KVTier."""
    if name == NONE:
        return None
    if name in BUILTIN:
        return BUILTIN[name]
    entry_points = _entry_points()
    if name in entry_points:
        cls = entry_points[name].load()
    elif ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise InvalidArgument(f"cannot load KV tier {name!r}: {err}") from err
    else:
        raise InvalidArgument(
            f"unknown KV tier {name!r}; choose one of {', '.join(available())} or give package.module:Class"
        )
    if not (isinstance(cls, type) and issubclass(cls, KVTier)):
        raise InvalidArgument(f"KV tier {name!r} is {cls!r}, not a KVTier subclass")
    return cls
