"""The image store's bookkeeping (docs/vision.md#image-store): which byte ranges of the store's data
(common/image_segment.py) hold which image's embeddings, keyed by a digest of the image under the model's
identity; leases that hold an entry while a step reads or writes it, per session; and the least recently
used entries no lease holds, evicted first when a new image needs room.

An entry is pending from the miss that created it until its lease ends: written, it is a hit for later
leases; not written, it is dropped. A lease on a pending entry (another step writes it) gets no range: its
step encodes the image itself. The data itself is only ever touched by compute."""

import bisect
from collections import Counter, OrderedDict
from dataclasses import dataclass

from common import image_segment
from common.errors import FailedPrecondition, InvalidArgument
from protos import cache_pb2

KEY_BYTES = 16
# Every range starts at a multiple of this, so a view of it in any dtype is aligned.
ALIGN = 64


@dataclass(slots=True)
class Entry:
    offset: int
    nbytes: int
    size: int  # bytes taken: nbytes rounded up to ALIGN
    leases: int = 1
    written: bool = False


@dataclass(frozen=True, slots=True)
class Lease:
    hit: bool
    offset: int = 0
    nbytes: int = 0  # 0: no range (compute encodes and keeps nothing in the store)


class ImageStore:
    """Entries in `capacity` bytes; not thread-safe (the servicer's lock guards it)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: dict[bytes, Entry] = {}
        # Written entries no lease holds, least recently used first: the evictable ones.
        self._idle: OrderedDict[bytes, None] = OrderedDict()
        # Free ranges (offset, size), sorted by offset, never adjacent (merged as they are freed).
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []
        # Per session, the leases it holds on each key.
        self._held: dict[str, Counter[bytes]] = {}
        self.hits = self.misses = self.evictions = self.not_stored = 0

    def acquire(self, session_id: str, images: list[tuple[bytes, int]]) -> list[Lease]:
        """A lease for each (key, nbytes), in order. InvalidArgument, changing nothing, for a key not of
        KEY_BYTES bytes or listed twice, nbytes < 1, or nbytes other than a written entry's of that key."""
        keys = [key for key, _ in images]
        for i, (key, nbytes) in enumerate(images):
            if len(key) != KEY_BYTES:
                raise InvalidArgument(f"images[{i}].key has {len(key)} bytes, not {KEY_BYTES}")
            if nbytes < 1:
                raise InvalidArgument(f"images[{i}].nbytes must be > 0, got {nbytes}")
            if keys.index(key) != i:
                raise InvalidArgument(f"images[{i}].key is images[{keys.index(key)}]'s: list each key once")
            entry = self._entries.get(key)
            if entry is not None and entry.written and entry.nbytes != nbytes:
                raise InvalidArgument(
                    f"images[{i}].nbytes is {nbytes}, the stored image of that key has {entry.nbytes}: "
                    "the key must name the model's identity"
                )
        held = self._held.setdefault(session_id, Counter())
        leases = []
        for key, nbytes in images:
            lease = self._acquire(key, nbytes)
            held[key] += 1
            leases.append(lease)
        return leases

    def _acquire(self, key: bytes, nbytes: int) -> Lease:
        entry = self._entries.get(key)
        if entry is not None:
            entry.leases += 1
            self._idle.pop(key, None)
            if entry.written:
                self.hits += 1
                return Lease(True, entry.offset, entry.nbytes)
            self.misses += 1
            return Lease(False)
        self.misses += 1
        size = -(-nbytes // ALIGN) * ALIGN
        offset = self._allocate(size)
        if offset is None:
            self.not_stored += 1
            return Lease(False)
        self._entries[key] = Entry(offset, nbytes, size)
        return Lease(False, offset, nbytes)

    def release(self, session_id: str, images: list[tuple[bytes, bool]]) -> None:
        """Ends the session's lease on each key, (key, written). InvalidArgument, changing nothing, for a key
        the session holds no lease on (or fewer than it lists)."""
        held = self._held.get(session_id, Counter())
        wanted = Counter(key for key, _ in images)
        for key, count in wanted.items():
            if held[key] < count:
                raise InvalidArgument(
                    f"session {session_id!r} holds {held[key]} leases on image key {key.hex()}, not {count}: "
                    "release only what AcquireImages leased"
                )
        for key, written in images:
            held[key] -= 1
            if not held[key]:
                del held[key]
            self._release(key, written)
        if not held:
            self._held.pop(session_id, None)

    def _release(self, key: bytes, written: bool) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.leases -= 1
        if not entry.written:
            if not written:
                if not entry.leases:
                    self._drop(key)
                return
            entry.written = True
        if not entry.leases:
            self._idle[key] = None

    def end_session(self, session_id: str) -> None:
        """Ends every lease the session holds, none written."""
        held = self._held.pop(session_id, Counter())
        for key, count in held.items():
            for _ in range(count):
                self._release(key, False)

    def stats(self) -> cache_pb2.ImageStoreStats:
        written = [entry for entry in self._entries.values() if entry.written]
        return cache_pb2.ImageStoreStats(
            capacity_bytes=self.capacity,
            stored_bytes=sum(entry.nbytes for entry in written),
            stored_images=len(written),
            leased_images=sum(1 for entry in self._entries.values() if entry.leases),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            not_stored=self.not_stored,
        )

    def _allocate(self, size: int) -> int | None:
        """The offset of `size` free bytes (the first range that fits), evicting idle entries, least
        recently used first, until one does; None if no eviction makes room."""
        if size > self.capacity:
            return None
        while True:
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, free - size)
                    return offset
            if not self._idle:
                return None
            key, _ = self._idle.popitem(last=False)
            self._drop(key)
            self.evictions += 1

    def _drop(self, key: bytes) -> None:
        """Forgets the entry and frees its range, merged with free neighbours."""
        entry = self._entries.pop(key)
        self._idle.pop(key, None)
        offset, size = entry.offset, entry.size
        i = bisect.bisect(self._free, (offset, size))
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            i -= 1
            del self._free[i]
        self._free.insert(i, (offset, size))


def create(request: cache_pb2.CreatePoolRequest, handle, memory: int) -> ImageStore | None:
    """The image store of a new pool whose CreatePool asks for one (request.image_store), `memory` bytes
    (--image-store-memory; 0: none), its file named in handle.image_store; None otherwise."""
    if not request.image_store or memory < 1:
        return None
    image_segment.create(handle, memory)
    return ImageStore(memory)


def leases(reply: list[Lease]) -> cache_pb2.ImageStoreLeases:
    return cache_pb2.ImageStoreLeases(
        leases=[
            cache_pb2.ImageStoreLease(hit=lease.hit, offset=lease.offset, nbytes=lease.nbytes)
            for lease in reply
        ]
    )


def require(store: ImageStore | None) -> ImageStore:
    if store is None:
        raise FailedPrecondition(
            "the pool has no image store: it is made for a model that takes images (CreatePoolRequest"
            ".image_store) when the cache service's --image-store-memory is above 0"
        )
    return store
