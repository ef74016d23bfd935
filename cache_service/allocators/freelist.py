"""The simplest allocator: a FIFO queue of free block ids."""

from collections import deque
from collections.abc import Sequence

from cache_service.allocators.base import BlockAllocator


class FreeListAllocator(BlockAllocator):
    """Allocates from the head of a deque and frees to its tail; ignores the placement hint."""

    name = "freelist"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._queue: deque[int] = deque(range(num_blocks))
        self._free = bytearray(b"\x01") * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._queue)

    def is_free(self, block_id: int) -> bool:
        return bool(self._free[block_id])

    def allocate(self, n: int, hint: Sequence[int] = ()) -> list[int]:
        assert 0 <= n <= len(self._queue), f"allocate({n}) with {len(self._queue)} free"
        block_ids = [self._queue.popleft() for _ in range(n)]
        for block_id in block_ids:
            assert self._free[block_id], block_id
            self._free[block_id] = 0
        return block_ids

    def _release(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            self._free[block_id] = 1
        self._queue.extend(block_ids)
