"""Keeps a sequence's blocks physically adjacent when it can, and counts how often it can."""

from collections.abc import Sequence

from cache_service.allocators.bitmap import BitmapAllocator


class ContiguousAllocator(BitmapAllocator):
    """Each new block is the one right after the sequence's previous block if that is free, else the
    lowest free block. `stats` reports placements that had a previous block and how many were adjacent."""

    name = "contiguous"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.placements = 0
        self.adjacent = 0

    def allocate(self, n: int, hint: Sequence[int] = ()) -> list[int]:
        assert 0 <= n <= self.num_free, f"allocate({n}) with {self.num_free} free"
        block_ids: list[int] = []
        previous = hint[-1] if hint else None
        for _ in range(n):
            want = previous + 1 if previous is not None else -1
            if previous is not None:
                self.placements += 1
            if 0 <= want < self.num_total and self.is_free(want):
                self.adjacent += 1
                previous = self._take(want)
            else:
                previous = self._take(self._first_free())
            block_ids.append(previous)
        return block_ids

    def stats(self) -> dict[str, float]:
        ratio = self.adjacent / self.placements if self.placements else 0.0
        return {"placements": self.placements, "adjacent": self.adjacent, "adjacent_ratio": ratio}
