"""Compute's side of the session fence (common/session_fence.py): a step of a session's sequences runs only
while the cache service holds that session open, checked in the pool's fence, never by a call to the cache."""

import contextlib
from collections.abc import Callable, Iterator

from common.errors import FailedPrecondition
from common.session_fence import SLOTS, SessionFence

NO_FENCE = "the attached pool has no session fence: attach the pool handle CreatePool returned"


def ended(epoch: int) -> str:
    return (
        f"session epoch {epoch} is not open at the cache service (the session lapsed or was closed, and the "
        "blocks it held may be another's): nothing was written; open a session and reserve again"
    )


class StepFence:
    """The attached pool's fence (None: a handle that names none), and the slot of each session seen."""

    def __init__(self, fence: SessionFence | None) -> None:
        self.fence = fence
        self._slots: dict[int, int] = {}

    @contextlib.contextmanager
    def holding(self, epoch: int) -> Iterator[Callable[[], None]]:
        """Holds the session's slot while the body runs, so the cache frees none of its blocks meanwhile;
        yields a check to call before each later step of the body (it raises once the session ended).
        FailedPrecondition when the session is not open. Epoch 0 (the unleased namespace): not fenced."""
        if epoch == 0:
            yield lambda: None
            return
        if self.fence is None:
            raise FailedPrecondition(NO_FENCE)
        slot = self._slot(epoch)
        if slot is None or not self.fence.hold(slot, epoch):
            raise FailedPrecondition(ended(epoch))
        try:
            yield lambda: self._check(slot, epoch)
        finally:
            self.fence.release(slot)

    def close(self) -> None:
        if self.fence is not None:
            self.fence.close()

    def _slot(self, epoch: int) -> int | None:
        # NOTE: a session keeps its slot while it is open: one found once is only read again.
        slot = self._slots.get(epoch)
        if slot is None:
            slot = self.fence.slot_of(epoch)
            if slot is not None:
                if len(self._slots) >= SLOTS:
                    self._slots.clear()
                self._slots[epoch] = slot
        return slot

    def _check(self, slot: int, epoch: int) -> None:
        if not self.fence.holds(slot, epoch):
            raise FailedPrecondition(ended(epoch))
