"""Allocators by name, so `--allocator NAME` picks one at start-up: a built-in (`freelist`, `bitmap`,
`contiguous`), an entry point in the group `pagedserve.allocators`, or `package.module:Class`
(cache_service/plugins.py)."""

from cache_service.allocators.base import BlockAllocator
from cache_service.allocators.bitmap import BitmapAllocator
from cache_service.allocators.contiguous import ContiguousAllocator
from cache_service.allocators.freelist import FreeListAllocator
from cache_service.plugins import Plugins

PLUGINS = Plugins(
    "allocator",
    BlockAllocator,
    "pagedserve.allocators",
    {cls.name: cls for cls in (FreeListAllocator, BitmapAllocator, ContiguousAllocator)},
)
available = PLUGINS.available


def resolve(name: str) -> type[BlockAllocator]:
    """The allocator class for `name`; InvalidArgument if it names none or not a BlockAllocator."""
    return PLUGINS.resolve(name)


def create(name: str, num_blocks: int) -> BlockAllocator:
    """A new allocator `name` managing blocks [0, num_blocks); InvalidArgument for an unknown name."""
    return resolve(name)(num_blocks)
