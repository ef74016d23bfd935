"""The session fence between two real processes (this one as the cache, a child as compute): a step holds its
session's slot, so a session that ends meanwhile keeps its blocks until the step is over; a step of an ended
session is refused; a compute that dies holds nothing. Fence files live in tmp_path here."""

import os

import pytest
import torch

from cache_service.allocators import registry
from cache_service.block_manager import BlockManager
from cache_service.sequence import SeqRequest
from cache_service.sessions import Sessions
from common import shared_pool
from common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from common.session_fence import SLOTS, SessionFence
from compute_service.fencing import StepFence
from tests.fence_compute import Compute

SPEC = shared_pool.PoolSpec(2, 8, 4, 2, 16, torch.float32)


@pytest.fixture
def pool(tmp_path):
    _, handle = shared_pool.create(SPEC, tmp_path)
    fence = SessionFence.create(handle, tmp_path)
    yield handle, fence
    fence.close()
    shared_pool.release(handle)


def test_the_fence_file_is_private_and_checked_like_a_segment(pool, tmp_path):
    handle, _ = pool
    info = os.stat(handle.fence.path)
    assert info.st_mode & 0o777 == 0o600 and info.st_size == handle.fence.nbytes
    assert handle.fence.path != handle.shm.path and len(set(handle.fence.token)) > 1
    SessionFence.open(handle, tmp_path).close()
    forged = type(handle)()
    forged.CopyFrom(handle)
    forged.fence.token = handle.shm.token
    with pytest.raises(InvalidArgument, match="its header does not match the handle's token"):
        SessionFence.open(forged, tmp_path)
    os.chmod(handle.fence.path, 0o644)
    with pytest.raises(InvalidArgument, match="its mode is 0644, not 0600"):
        SessionFence.open(handle, tmp_path)


def test_a_session_ended_during_a_step_is_quiet_only_once_the_step_is_over(pool, tmp_path):
    handle, fence = pool
    compute = Compute(handle, tmp_path)
    try:
        fence.publish(7, 1234)
        assert compute.ask("hold", 7, 1234) == "True", "an open session's step runs"
        assert compute.ask("hold", 8, 1234) == "False", "not its slot"
        assert not fence.end(7), "ended while its step runs"
        assert compute.ask("holds", 7, 1234) == "False", "its next step would be refused"
        assert not fence.quiet(7)
        assert compute.ask("release", 7, 1234) == "released"
        assert fence.quiet(7), "the step is over"
        assert compute.ask("hold", 7, 1234) == "False", "a step of the ended session is refused"
        fence.publish(7, 99)
        assert compute.ask("hold", 7, 99) == "True"
    finally:
        compute.kill()
    assert fence.end(7), "a compute that died holds nothing"


def test_the_cache_frees_an_ended_sessions_blocks_only_after_computes_step(pool, tmp_path):
    handle, fence = pool
    clock = Clock()
    blocks = BlockManager(registry.create("freelist", SPEC.num_blocks), SPEC.block_size)
    sessions = Sessions(1.0, 1.0, clock)
    session = sessions.open("gateway", 0.0)
    sessions.attach(fence)
    blocks.reserve([SeqRequest("a", 10)], [])
    sessions.reserved("gateway", [("a", 0)])
    slot = fence_slot(fence, session.epoch)
    compute = Compute(handle, tmp_path)
    try:
        assert compute.ask("hold", slot, session.epoch) == "True"
        clock.now += 2.0
        assert sessions.sweep(blocks) == ["gateway"], "the session lapsed"
        assert blocks.stats().used_blocks == 3 and sessions.num_ending == 1, "its blocks wait for the step"
        sessions.sweep(blocks)
        assert blocks.stats().used_blocks == 3
        compute.ask("release", slot, session.epoch)
        sessions.sweep(blocks)
        assert blocks.stats().used_blocks == 0 and sessions.num_ending == 0
    finally:
        compute.kill()
    blocks.check_invariants()


def fence_slot(fence: SessionFence, epoch: int) -> int:
    slot = fence.slot_of(epoch)
    assert slot is not None, epoch
    return slot


def test_computes_step_fence_refuses_an_ended_session_and_passes_the_unleased(pool, tmp_path):
    handle, fence = pool
    steps = StepFence(SessionFence.open(handle, tmp_path))
    fence.publish(3, 42)
    with steps.holding(42) as still_open:
        still_open()
    with steps.holding(0) as still_open:
        still_open()
    refused = pytest.raises(FailedPrecondition, match="session epoch 43 is not open at the cache service")
    with refused, steps.holding(43):
        pass
    ended = pytest.raises(FailedPrecondition, match="session epoch 42 is not open")
    with ended, steps.holding(42) as still_open:
        fence.end(3)
        still_open()
    with pytest.raises(FailedPrecondition, match="session epoch 42 is not open"), steps.holding(42):
        pass
    steps.close()
    no_fence = pytest.raises(FailedPrecondition, match="the attached pool has no session fence")
    with no_fence, StepFence(None).holding(42):
        pass


def test_at_most_slots_sessions_are_open_at_once():
    sessions = Sessions(1.0, 1.0, Clock())
    epochs = {sessions.open(f"s{index}", 0.0).epoch for index in range(SLOTS)}
    assert len(epochs) == SLOTS and 0 not in epochs
    with pytest.raises(
        ResourceExhausted, match=f"{SLOTS} sessions are open, the most the cache service fences"
    ):
        sessions.open("one more", 0.0)
    sessions.close("s0", None)
    assert sessions.open("one more", 0.0).epoch not in epochs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
