"""A block manager over a fake pool that records what compute would have written, for unit tests."""

from cache_service.allocators import registry
from cache_service.block_manager import BlockManager

BS = 4


class FakePool:
    """What compute would have written: the token id at every slot; copy_block copies a block's slots."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.copies: list[tuple[int, int]] = []

    def copy_block(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))
        for offset in range(BS):
            if src * BS + offset in self.slots:
                self.slots[dst * BS + offset] = self.slots[src * BS + offset]
            else:
                self.slots.pop(dst * BS + offset, None)

    def write(self, table: list[int], tokens: list[int], start: int) -> None:
        for position in range(start, len(tokens)):
            self.slots[table[position // BS] * BS + position % BS] = tokens[position]

    def read(self, table: list[int], n: int) -> list[int | None]:
        return [self.slots.get(table[p // BS] * BS + p % BS) for p in range(n)]


def manager(num_blocks: int = 16, allocator: str = "freelist", **kw) -> tuple[BlockManager, FakePool]:
    pool = FakePool()
    return BlockManager(registry.create(allocator, num_blocks), BS, pool.copy_block, **kw), pool
