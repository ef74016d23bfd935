"""Sessions (leases): which caller owns each sequence, and what happens when an owner stops renewing.

A caller opens a session (an id it chose, a TTL) and renews it within the TTL; the sequences its calls
create belong to it, and its calls may touch no other. A session that lapses, or is closed, has every
sequence it holds freed, with the progress last reported for each (so written full blocks stay cached).

Each opening of a session has an epoch, published in the pool's session fence (common/session_fence.py)
while it is open: compute runs a step of the session only then. A session that ends while compute runs one
of its steps has its sequences freed once that step is over (at a later sweep), never before.
"""

import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from cache_service.block_manager import BlockManager
from common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from common.session_fence import SLOTS, SessionFence

# The namespace of calls that name no session: it never lapses (grpcurl, tests, older gateways).
UNLEASED = ""
# Lapsed session ids remembered, so that their late calls say "expired" rather than "unknown".
REMEMBERED_LAPSED = 1024


@dataclass(slots=True)
class Session:
    ttl_s: float
    deadline: float
    # Sequence id -> its leading tokens last reported written (what a lapse frees it with).
    seqs: dict[str, int] = field(default_factory=dict)
    # This opening's epoch (never 0) and its slot in the fence (-1: the unleased namespace, never fenced).
    epoch: int = 0
    slot: int = -1


class Sessions:
    """The open sessions and the sequences each owns. Not thread-safe: the servicer's lock guards it.

    NOTE: the record of a call is made after the block manager accepted it (`reserved`, `forked`, `freed`),
    so a refused call changes nothing here either.
    """

    def __init__(
        self, default_ttl_s: float, max_ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        assert 0 < default_ttl_s <= max_ttl_s, (default_ttl_s, max_ttl_s)
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self._clock = clock
        self._open: dict[str, Session] = {UNLEASED: Session(math.inf, math.inf)}
        self._lapsed: OrderedDict[str, None] = OrderedDict()
        self._fence: SessionFence | None = None
        self._free_slots = list(range(SLOTS - 1, -1, -1))
        # Sessions that ended while compute ran a step of theirs: their sequences are freed once it is over.
        self._ending: list[Session] = []

    def __len__(self) -> int:
        """Open sessions, the unleased namespace not counted."""
        return len(self._open) - 1

    # lifecycle

    def attach(self, fence: SessionFence) -> None:
        """The pool's fence, from its creation on: every open session's epoch is published in it."""
        self._fence = fence
        for session in self._open.values():
            if session.slot >= 0:
                fence.publish(session.slot, session.epoch)

    def open(self, session_id: str, ttl_s: float) -> Session:
        """Opens the session, or renews it if open (a lapsed one starts afresh, empty, with a new epoch);
        returns it: ttl_s granted (the request's, or the default for 0, capped at the maximum), its epoch,
        the sequences it holds. ResourceExhausted when SLOTS sessions are open (or ending) already."""
        if not session_id:
            raise InvalidArgument("session_id must not be empty")
        if not (math.isfinite(ttl_s) and ttl_s >= 0):
            raise InvalidArgument(f"ttl_s must be >= 0 seconds (0: the default), got {ttl_s}")
        ttl = min(ttl_s or self.default_ttl_s, self.max_ttl_s)
        session = self._open.get(session_id)
        if session is None:
            if not self._free_slots:
                raise ResourceExhausted(
                    f"{SLOTS} sessions are open, the most the cache service fences: close the sessions "
                    "no longer used"
                )
            session = self._open[session_id] = Session(ttl, 0.0, epoch=secrets.randbelow(2**63 - 1) + 1)
            session.slot = self._free_slots.pop()
            if self._fence is not None:
                self._fence.publish(session.slot, session.epoch)
            self._lapsed.pop(session_id, None)
        session.ttl_s, session.deadline = ttl, self._clock() + ttl
        return session

    def renew(self, session_id: str) -> Session:
        """Moves the session's deadline one TTL on and returns it. FailedPrecondition if it lapsed or is
        unknown."""
        session = self._live(session_id)
        session.deadline = self._clock() + session.ttl_s
        return session

    def close(self, session_id: str, blocks: BlockManager | None) -> tuple[int, int]:
        """Frees every sequence of the session and ends it; returns (sequences, blocks that left use).
        Closing a lapsed session frees nothing (its lapse did); NotFound for a session never opened, closed
        already, or opened before the cache service restarted."""
        if session_id == UNLEASED:
            raise InvalidArgument("session_id must not be empty")
        session = self._open.pop(session_id, None)
        if session is not None:
            return len(session.seqs), self._end(session, blocks)
        if session_id in self._lapsed:
            return 0, 0
        raise NotFound(
            f"no session {session_id!r} to close: it was never opened, is closed already, or the cache "
            "service restarted since (which freed every sequence)"
        )

    def sweep(self, blocks: BlockManager | None) -> list[str]:
        """Frees the sequences of ended sessions whose last step is over, then lapses every session past its
        deadline, freeing its sequences (once no step of it runs); returns the ids lapsed."""
        ending, self._ending = self._ending, []
        for session in ending:
            self._end(session, blocks)
        now = self._clock()
        lapsed = [session_id for session_id, session in self._open.items() if session.deadline < now]
        for session_id in lapsed:
            self._end(self._open.pop(session_id), blocks)
            self._lapsed[session_id] = None
            while len(self._lapsed) > REMEMBERED_LAPSED:
                self._lapsed.popitem(last=False)
        return lapsed

    @property
    def num_ending(self) -> int:
        """Sessions ended whose sequences wait for compute's step of theirs to be over."""
        return len(self._ending)

    # ownership

    def check_owns(self, session_id: str, seq_ids: Iterable[str]) -> None:
        """FailedPrecondition if the session is not open; NotFound for sequences it does not hold (unknown,
        freed, or another session's)."""
        session = self._live(session_id)
        foreign = sorted({seq_id for seq_id in seq_ids if seq_id not in session.seqs})
        if foreign:
            raise NotFound(
                f"sequences {foreign} have no block table in session {session_id!r}: Reserve them as new "
                "first (or they were freed, or belong to another session)"
            )

    def reserved(self, session_id: str, progress: Sequence[tuple[str, int]]) -> None:
        """After a Reserve: (sequence, tokens known written) of its new and running sequences."""
        self._open[session_id].seqs.update(progress)

    def forked(self, session_id: str, parent_id: str, child_ids: Sequence[str]) -> None:
        seqs = self._open[session_id].seqs
        seqs.update((child_id, seqs[parent_id]) for child_id in child_ids)

    def freed(self, session_id: str, seq_ids: Sequence[str]) -> None:
        seqs = self._open[session_id].seqs
        for seq_id in seq_ids:
            del seqs[seq_id]

    def _live(self, session_id: str) -> Session:
        session = self._open.get(session_id)
        if session is not None:
            return session
        if session_id in self._lapsed:
            raise FailedPrecondition(
                f"session {session_id!r} expired: its sequences were freed; re-register (OpenSession)"
            )
        raise FailedPrecondition(
            f"unknown session {session_id!r}: OpenSession first (the cache service may have restarted, "
            "freeing every sequence)"
        )

    def _end(self, session: Session, blocks: BlockManager | None) -> int:
        """Takes the session out of the fence; frees its sequences and slot (returning the blocks that left
        use) unless compute runs a step of it: then it waits in `_ending` (0)."""
        if self._fence is not None and not self._fence.end(session.slot):
            self._ending.append(session)
            return 0
        self._free_slots.append(session.slot)
        return _free_all(session, blocks)


def _free_all(session: Session, blocks: BlockManager | None) -> int:
    if not session.seqs:
        return 0
    assert blocks is not None, "sequences are held but there is no pool"
    return blocks.free(list(session.seqs), session.seqs)
