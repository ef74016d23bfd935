"""A third-party allocator, loaded by dotted path or entry point in the tests: a LIFO stack of free ids."""

from collections.abc import Sequence

from cache_service.allocators.base import BlockAllocator
from common.errors import FailedPrecondition, InvalidArgument


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

    def free(self, block_ids: Sequence[int]) -> None:
        for index, block_id in enumerate(block_ids):
            if not 0 <= block_id < self.num_total:
                raise InvalidArgument(
                    f"block {block_id} does not exist: the pool has {self.num_total} blocks"
                )
            if block_id in self._free or block_id in block_ids[:index]:
                raise FailedPrecondition(f"block {block_id} is already free (double free)")
        self._stack.extend(block_ids)
        self._free.update(block_ids)
