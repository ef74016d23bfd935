"""The interface every block allocator implements: which physical blocks are free, and handing them out."""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from common.errors import FailedPrecondition, InvalidArgument


class BlockAllocator(ABC):
    """Hands out block ids in [0, num_total); knows nothing about sequences or refcounts.

    The caller checks `num_free` before `allocate`; an allocator never fails for lack of blocks.
    """

    name: ClassVar[str]

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, num_blocks
        self._num_total = num_blocks

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    @abstractmethod
    def num_free(self) -> int: ...

    @abstractmethod
    def is_free(self, block_id: int) -> bool:
        """Whether `block_id` (assumed in range) is free."""

    @abstractmethod
    def allocate(self, n: int, hint: Sequence[int] = ()) -> list[int]:
        """Returns n distinct free block ids, now used. Requires n <= num_free.

        `hint` lists the blocks the sequence already holds, so an allocator may place new ones near them.
        """

    def free(self, block_ids: Sequence[int]) -> None:
        """Returns used blocks to the free set; all or nothing.

        Raises InvalidArgument for an id out of range, FailedPrecondition for one already free
        (or listed twice).
        """
        seen: set[int] = set()
        for block_id in block_ids:
            if not 0 <= block_id < self.num_total:
                raise InvalidArgument(
                    f"block {block_id} does not exist: the pool has {self.num_total} blocks"
                )
            if self.is_free(block_id) or block_id in seen:
                raise FailedPrecondition(f"block {block_id} is already free (double free)")
            seen.add(block_id)
        self._release(block_ids)

    @abstractmethod
    def _release(self, block_ids: Sequence[int]) -> None:
        """Marks blocks free; `free` has checked they are distinct, in range and used."""

    def stats(self) -> dict[str, float]:
        """Allocator-specific counters for GetStats (e.g. how often placement succeeded); none by default."""
        return {}
