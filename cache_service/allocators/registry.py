"""Allocators by name, so `--allocator NAME` picks one at start-up."""

from cache_service.allocators.base import BlockAllocator
from cache_service.allocators.freelist import FreeListAllocator
from common.errors import InvalidArgument

ALLOCATORS: dict[str, type[BlockAllocator]] = {cls.name: cls for cls in (FreeListAllocator,)}


def available() -> list[str]:
    return sorted(ALLOCATORS)


def create(name: str, num_blocks: int) -> BlockAllocator:
    """A new allocator `name` managing blocks [0, num_blocks); InvalidArgument for an unknown name."""
    if name not in ALLOCATORS:
        raise InvalidArgument(f"unknown allocator {name!r}; choose one of {', '.join(available())}")
    return ALLOCATORS[name](num_blocks)
