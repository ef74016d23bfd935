"""The image store's bookkeeping (cache_service/image_store.py): leases on ranges keyed by image, a miss
written becoming a hit, refcounts that keep an entry while a step uses it, least-recently-used eviction of
idle entries only, images larger than the store or a store full of leased ones not stored, keys never
confused, bad calls refused changing nothing; its file, mapped by compute only with its handle; and the cache
service's part: a store made with a pool that asks for one, a lapsed session's leases ended only once
compute's step of it is over (a child process holds the session fence), leases refused without a store."""

from pathlib import Path

import pytest
import structlog
import torch

from cache_service.image_store import ALIGN, ImageStore
from cache_service.servicer import CacheServicer
from cache_service.sessions import Sessions
from common import image_segment, shared_pool
from common.errors import FailedPrecondition, InvalidArgument
from common.session_fence import SessionFence
from common.shared_pool import PoolSpec
from common.shm_files import SHM_DIR
from protos import cache_pb2
from tests.fence_compute import Compute

S = "session"


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def stored(store: ImageStore, n: int, nbytes: int = 100):
    """Leases image n, writes it, ends the lease; returns the lease."""
    (lease,) = store.acquire(S, [(key(n), nbytes)])
    store.release(S, [(key(n), True)])
    return lease


def test_a_written_miss_is_a_hit_at_the_same_range_and_another_key_is_a_miss():
    store = ImageStore(10 * ALIGN)
    first = stored(store, 1)
    assert not first.hit and first.nbytes == 100
    (again, other) = store.acquire(S, [(key(1), 100), (key(2), 100)])
    assert again.hit and (again.offset, again.nbytes) == (first.offset, 100)
    assert not other.hit and other.nbytes == 100
    # ranges never overlap
    assert other.offset >= first.offset + 100 or other.offset + 100 <= first.offset
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.stored_images, stats.leased_images) == (1, 2, 1, 2)


def test_a_miss_not_written_is_dropped_and_stays_a_miss():
    store = ImageStore(10 * ALIGN)
    store.acquire(S, [(key(1), 100)])
    store.release(S, [(key(1), False)])
    (lease,) = store.acquire(S, [(key(1), 100)])
    assert not lease.hit and lease.nbytes == 100
    assert store.stats().stored_images == 0


def test_a_pending_image_gives_other_leases_no_range():
    store = ImageStore(10 * ALIGN)
    (writer,) = store.acquire("a", [(key(1), 100)])
    (reader,) = store.acquire("b", [(key(1), 100)])
    assert writer.nbytes == 100 and not reader.hit and reader.nbytes == 0
    store.release("a", [(key(1), True)])
    store.release("b", [(key(1), False)])
    assert stored(store, 1).hit


def test_the_least_recently_used_idle_image_is_evicted_and_a_leased_one_never():
    store = ImageStore(3 * 128)  # three images of 128 bytes
    for n in (1, 2, 3):
        stored(store, n, 128)
    store.acquire(S, [(key(1), 128)])  # 1 used again (and held), 2 is the least recently used idle one
    fourth = stored(store, 4, 128)
    assert fourth.nbytes == 128 and store.stats().evictions == 1
    hits = {n: store.acquire(S, [(key(n), 128)])[0].hit for n in (3, 2)}
    assert hits == {3: True, 2: False}


def test_an_image_larger_than_the_store_or_a_full_store_of_leased_images_is_not_stored():
    store = ImageStore(2 * 128)
    (huge,) = store.acquire(S, [(key(9), 2 * 128 + 1)])
    assert (huge.hit, huge.nbytes) == (False, 0)
    store.acquire(S, [(key(1), 128), (key(2), 128)])  # both held, pending
    (third,) = store.acquire(S, [(key(3), 128)])
    assert third.nbytes == 0 and store.stats().not_stored == 2
    store.release(S, [(key(9), False), (key(1), True), (key(2), True), (key(3), False)])
    assert store.stats().leased_images == 0 and store.stats().stored_images == 2


def test_freed_ranges_merge_so_a_larger_image_fits_after_small_ones_go():
    store = ImageStore(4 * 128)
    for n in range(4):
        stored(store, n, 128)
    big = stored(store, 10, 4 * 128)  # every small one evicted; their ranges merged into one
    assert big.nbytes == 4 * 128 and big.offset == 0 and store.stats().evictions == 4


def test_an_ended_session_releases_its_leases_and_drops_what_it_did_not_write():
    store = ImageStore(10 * ALIGN)
    stored(store, 1)
    store.acquire("gone", [(key(1), 100), (key(2), 100)])
    store.end_session("gone")
    stats = store.stats()
    assert (stats.leased_images, stats.stored_images) == (0, 1)
    assert not store.acquire(S, [(key(2), 100)])[0].hit


@pytest.mark.parametrize(
    ("images", "says"),
    [
        ([(b"short", 10)], "has 5 bytes, not 16"),
        ([(key(1), 0)], "nbytes must be > 0"),
        ([(key(1), 10), (key(1), 10)], "list each key once"),
        ([(key(7), 10), (key(5), 99)], "the stored image of that key has 100"),
    ],
)
def test_a_bad_acquire_is_refused_changing_nothing(images, says):
    store = ImageStore(10 * ALIGN)
    stored(store, 5)
    before = store.stats()
    with pytest.raises(InvalidArgument, match=says):
        store.acquire(S, images)
    assert store.stats() == before
    assert store.acquire(S, [(key(7), 10)])[0].nbytes == 10, "key 7 was not leased by the refusal"


def test_releasing_what_the_session_does_not_hold_is_refused_changing_nothing():
    store = ImageStore(10 * ALIGN)
    store.acquire("a", [(key(1), 100)])
    with pytest.raises(InvalidArgument, match="holds 0 leases"):
        store.release("b", [(key(1), True)])
    with pytest.raises(InvalidArgument, match="holds 1 leases on image key .* not 2"):
        store.release("a", [(key(1), True), (key(1), True)])
    assert store.stats().leased_images == 1
    store.release("a", [(key(1), True)])
    assert store.acquire(S, [(key(1), 100)])[0].hit


def test_compute_maps_the_store_file_only_with_its_handle(tmp_path):
    spec = PoolSpec(1, 2, 4, 1, 8, torch.float32)
    _, handle = shared_pool.create(spec, tmp_path)
    image_segment.create(handle, 4096, tmp_path)
    try:
        mine = image_segment.open_store(handle, tmp_path)
        theirs = image_segment.open_store(handle, tmp_path)
        mine[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert theirs[:4].tolist() == [1, 2, 3, 4] and len(mine) == 4096
        forged = type(handle)()
        forged.CopyFrom(handle)
        forged.image_store.token = bytes(32)
        with pytest.raises(InvalidArgument, match="header does not match the handle's token"):
            image_segment.open_store(forged, tmp_path)
    finally:
        shared_pool.release(handle)
    assert not list(tmp_path.iterdir())


def test_stats_count_bytes_of_written_images():
    store = ImageStore(10 * ALIGN)
    stored(store, 1, 100)
    stored(store, 2, 30)
    stats = store.stats()
    assert isinstance(stats, cache_pb2.ImageStoreStats)
    assert (stats.capacity_bytes, stats.stored_bytes, stats.stored_images) == (10 * ALIGN, 130, 2)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_cache_ends_a_lapsed_sessions_image_leases_only_after_computes_step():
    clock = Clock()
    servicer = CacheServicer(
        "freelist", 8, 0, structlog.get_logger(), sessions=Sessions(1.0, 1.0, clock), image_store_memory=4096
    )
    geometry = cache_pb2.PoolGeometry(num_layers=1, num_kv_heads=1, head_dim=4)
    request = cache_pb2.CreatePoolRequest(
        geometry=geometry, block_size=4, kv_dtype="float32", image_store=True
    )
    handle = servicer.CreatePool(request, None)
    compute = Compute(handle, SHM_DIR)
    try:
        assert handle.image_store.nbytes == 4096 and Path(handle.image_store.path).is_file()
        session = servicer.OpenSession(cache_pb2.OpenSessionRequest(session_id="gw", ttl_s=1.0), None)
        leases = servicer.AcquireImages(
            cache_pb2.ImageStoreAcquireRequest(
                session_id="gw", images=[cache_pb2.ImageStoreKey(key=key(1), nbytes=640)]
            ),
            None,
        )
        assert leases.leases[0].nbytes == 640 and not leases.leases[0].hit
        slot = SessionFence.open(handle).slot_of(session.epoch)
        assert compute.ask("hold", slot, session.epoch) == "True", "a step of the session runs"
        clock.now += 2.0
        servicer.sweep()
        stats = servicer.GetStats(cache_pb2.GetStatsRequest(), None).image_store
        assert stats.leased_images == 1, "the range the step may write stays leased"
        compute.ask("release", slot, session.epoch)
        servicer.sweep()
        stats = servicer.GetStats(cache_pb2.GetStatsRequest(), None).image_store
        assert (stats.leased_images, stats.stored_images) == (0, 0), "the unwritten image is dropped"
    finally:
        compute.kill()
        servicer.close()
    assert not Path(handle.image_store.path).exists()


def test_image_leases_on_a_pool_without_a_store_are_refused():
    servicer = CacheServicer("freelist", 8, 0, structlog.get_logger(), image_store_memory=4096)
    geometry = cache_pb2.PoolGeometry(num_layers=1, num_kv_heads=1, head_dim=4)
    handle = servicer.CreatePool(
        cache_pb2.CreatePoolRequest(geometry=geometry, block_size=4, kv_dtype="float32"), None
    )
    try:
        assert not handle.HasField("image_store")
        servicer.OpenSession(cache_pb2.OpenSessionRequest(session_id="gw"), None)
        request = cache_pb2.ImageStoreAcquireRequest(
            session_id="gw", images=[cache_pb2.ImageStoreKey(key=key(1), nbytes=64)]
        )
        with pytest.raises(FailedPrecondition, match="the pool has no image store"):
            servicer.AcquireImages(request, None)
        assert not servicer.GetStats(cache_pb2.GetStatsRequest(), None).HasField("image_store")
    finally:
        servicer.close()
