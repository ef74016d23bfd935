"""A third-party allocator, loaded by dotted path or entry point in the tests: a LIFO stack of free ids."""

from collections.abc import Sequence

from cache_service.allocators.base import BlockAllocator


class StackAllocator(BlockAllocator):
    """Hands out the most recently freed blocks first."""

    name = "toy-stack"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._stack = list(reversed(range(num_blocks)))
        self._free = set(self._stack)

    @property
    def num_free(self) -> int:
        return len(self._stack)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def allocate(self, n: int, hint: Sequence[int] = ()) -> list[int]:
        assert 0 <= n <= len(self._stack)
        block_ids = [self._stack.pop() for _ in range(n)]
        self._free.difference_update(block_ids)
        return block_ids

    def _release(self, block_ids: Sequence[int]) -> None:
        self._stack.extend(block_ids)
        self._free.update(block_ids)
