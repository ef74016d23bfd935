"""Allocators by name, so `--allocator NAME` picks one at start-up.

A name is a built-in (`freelist`, `bitmap`, `contiguous`), an entry point in the group
`pagedserve.allocators` of any installed distribution, or a dotted path `package.module:Class`;
third-party allocators need no change to pagedserve.
"""

import importlib
from importlib import metadata

from cache_service.allocators.base import BlockAllocator
from cache_service.allocators.bitmap import BitmapAllocator
from cache_service.allocators.contiguous import ContiguousAllocator
from cache_service.allocators.freelist import FreeListAllocator
from common.errors import InvalidArgument

ENTRY_POINT_GROUP = "pagedserve.allocators"
BUILTIN: dict[str, type[BlockAllocator]] = {
    cls.name: cls for cls in (FreeListAllocator, BitmapAllocator, ContiguousAllocator)
}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available() -> list[str]:
    """Built-in and entry-point names (dotted paths are accepted too, but not listed)."""
    return sorted(BUILTIN.keys() | _entry_points().keys())


def resolve(name: str) -> type[BlockAllocator]:
    """The allocator class for `name`; InvalidArgument if it names none or not a BlockAllocator."""
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
            raise InvalidArgument(f"cannot load allocator {name!r}: {err}") from err
    else:
        raise InvalidArgument(
            f"unknown allocator {name!r}; choose one of {', '.join(available())} or give package.module:Class"
        )
    if not (isinstance(cls, type) and issubclass(cls, BlockAllocator)):
        raise InvalidArgument(f"allocator {name!r} is {cls!r}, not a BlockAllocator subclass")
    return cls


def create(name: str, num_blocks: int) -> BlockAllocator:
    """A new allocator `name` managing blocks [0, num_blocks); InvalidArgument for an unknown name."""
    return resolve(name)(num_blocks)
