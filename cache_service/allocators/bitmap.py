"""A bitmap of free blocks; allocation takes the lowest free ids first."""

from collections.abc import Sequence

from cache_service.allocators.base import BlockAllocator

_FREE = b"\x01"


class BitmapAllocator(BlockAllocator):
    """One byte per block (1 = free); `allocate` returns the first free blocks and ignores the hint."""

    name = "bitmap"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._bits = bytearray(_FREE) * num_blocks
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    def is_free(self, block_id: int) -> bool:
        return bool(self._bits[block_id])

    def allocate(self, n: int, hint: Sequence[int] = ()) -> list[int]:
        assert 0 <= n <= self._num_free, f"allocate({n}) with {self._num_free} free"
        block_ids, start = [], 0
        for _ in range(n):
            start = self._first_free(start)
            block_ids.append(self._take(start))
        return block_ids

    def _release(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            self._bits[block_id] = 1
        self._num_free += len(block_ids)

    def _first_free(self, start: int = 0) -> int:
        return self._bits.find(_FREE, start)

    def _take(self, block_id: int) -> int:
        assert 0 <= block_id < self.num_total and self._bits[block_id], block_id
        self._bits[block_id] = 0
        self._num_free -= 1
        return block_id
