"""The engine when a peer is lost: re-handshake and recompute with the same tokens, the grace period, fault
isolation of one step (and of the rows compute refuses by name), a dead loop, shutdown; and the recovery state
machine, step deadline, stream cap."""

import threading
import time
from dataclasses import replace

import grpc
import pytest

from common.errors import InvalidArgument, PagedServeError, Unavailable
from gateway.recovery import FIRST_DELAY_S, MAX_DELAY_S, PeerFault, PeerRecovery
from gateway.sequence import Sequence
from gateway.step_deadline import FLOOR_S, WARMUP, StepDeadline
from gateway.streams import SPARE_THREADS, StreamSlots
from tests.fake_engine import (
    BLOCKS,
    CACHE,
    COMPUTE,
    GREEDY,
    PROMPTS,
    assert_nothing_held,
    collect,
    run_all,
    start,
    submit,
    tokenizer,
)
from tests.fake_peers import FakeCompute, RpcError, unreachable

__all__ = ["start", "tokenizer"]  # fixtures


@pytest.fixture
def reference(start):
    engine, cache, _ = start()
    outputs = run_all(engine)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in outputs), outputs
    return outputs


def test_a_restarted_cache_gets_a_new_pool_and_every_sequence_is_recomputed(start, reference):
    engine, cache, compute = start()
    epoch = cache.epoch
    # NOTE: the restarted cache's pool is a new segment: compute drops the old one (its segment watch)
    compute.before[4] = lambda: (cache.restart(num_blocks=BLOCKS // 2), compute.restart())
    assert run_all(engine) == reference
    assert not compute.before, "the fault happened"
    assert cache.epoch not in ("", epoch) and compute.epoch == cache.epoch
    assert engine.kv.num_blocks == engine.kv.available_blocks == BLOCKS // 2, (
        "the view has the new pool's size"
    )
    assert cache.tables == {} and len(cache.free) == BLOCKS // 2


def test_the_engine_fails_only_the_refused_request_and_the_others_end_with_their_tokens(start, reference):
    engine, cache, compute = start()
    compute.refused = {1}
    prompts = [[5, 6, 7, 8, 9], [40, 41, 1, 43], list(range(10, 19)), list(range(20, 33))]
    seqs = [submit(engine, prompt) for prompt in prompts]
    outputs = [collect(seq) for seq in seqs]
    assert isinstance(outputs[1], InvalidArgument) and "token_ids hold a token of [1]" in str(outputs[1])
    assert [outputs[0], *outputs[2:]] == reference
    assert cache.tables == {} and len(cache.free) == 64, "the refused request's blocks are freed"
    assert not engine.scheduler.has_work()


def test_a_refused_row_ends_every_sample_of_its_request(start):
    engine, cache, compute = start()
    # NOTE: samples 1 and 2 fork after the first step and recompute the prompt's last token (2) in the second
    compute.before[2] = lambda: compute.refused.add(2)
    samples = Sequence(seq_id="n3", prompt_ids=[5, 6, 2], sampling=replace(GREEDY, n=3), max_len=512,
                       request_id="n3")  # fmt: skip
    engine.submit(samples)
    good = submit(engine, [5, 6, 7, 8, 9])
    first = samples.outbox.get(timeout=20)
    assert first.index == 0 and len(first.token_ids) == 1, "the parent sampled its first token"
    assert isinstance(collect(samples), InvalidArgument)
    assert samples.outbox.empty(), "the request ended once, with every sample"
    assert len(collect(good)) == GREEDY.max_tokens
    assert not engine.scheduler.has_work() and cache.tables == {}


def test_a_compute_step_past_its_deadline_counts_as_compute_lost(start, reference):
    engine, cache, compute = start()

    def too_slow():
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    compute.before[3] = too_slow
    assert run_all(engine) == reference
    assert not compute.before, "the fault happened"
    assert_nothing_held(engine, cache)


def test_a_restart_the_health_check_reports_during_the_handshake_that_attached_it_is_not_lost_again(
    start, reference
):
    engine, cache, compute = start()
    attach, attaches, down_at = compute.AttachPool, [], []

    def die():
        down_at.append(time.monotonic())
        raise unreachable("compute")

    def attach_pool(handle, **kwargs):
        reply = attach(handle, **kwargs)
        attaches.append(handle.epoch)
        # The health watcher saw compute down before it restarted, and tells the engine while it attaches.
        engine.peer_restarted("compute", down_at[0])
        return reply

    compute.before[3] = die
    compute.AttachPool = attach_pool
    assert run_all(engine) == reference
    assert attaches == [cache.epoch], "attached once after the loss, not again for the notice"
    assert_nothing_held(engine, cache)


def test_a_gone_prefill_compute_leaves_the_compute_serving_alone_until_it_is_attached_again(start, reference):
    prefill = FakeCompute()
    engine, cache, compute = start(prefill=prefill, prefill_threshold=4)
    lane = engine.runner.prefill

    def die():
        prefill.down = True
        raise unreachable("prefill")

    prefill.before[1] = die
    attaches = count_attaches(compute)
    assert run_all(engine) == reference, "the prompts the prefill compute had ran on the compute"
    assert not lane.attached and not prefill.before and attaches == [], "no handshake: the engine stepped on"
    assert_nothing_held(engine, cache)
    prefill.down = False
    for _ in range(100):
        if lane.attached:
            break
        threading.Event().wait(0.05)
    assert lane.attached and prefill.epoch == cache.epoch
    forwards = prefill.forwards
    assert run_all(engine) == reference
    assert prefill.forwards > forwards, "the prompts route to the prefill compute again"


def test_a_prefill_compute_past_its_deadline_stops_the_engine_until_it_answers(start, reference):
    prefill = FakeCompute()
    engine, cache, compute = start(prefill=prefill, prefill_threshold=4)

    def stalled():
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    prefill.before[1] = stalled
    attaches = count_attaches(compute)
    assert run_all(engine) == reference
    assert attaches == [cache.epoch], "a stalled prefill compute may still write: the engine waited for it"
    assert engine.runner.prefill.attached
    assert_nothing_held(engine, cache)


def count_attaches(compute: FakeCompute) -> list[str]:
    """The epochs of the compute's AttachPool calls from now on."""
    attach, epochs = compute.AttachPool, []

    def counted(handle, **kwargs):
        epochs.append(handle.epoch)
        return attach(handle, **kwargs)

    compute.AttachPool = counted
    return epochs


def test_past_the_grace_requests_fail_naming_the_lost_service_and_new_ones_are_refused(start, reference):
    engine, cache, compute = start(grace=0.5)

    def die():
        compute.down = True
        raise unreachable("compute")

    compute.before[2] = die
    for result in run_all(engine):
        assert isinstance(result, Unavailable), result
        assert f"compute service at {COMPUTE} unreachable" in str(result)
    with pytest.raises(Unavailable, match="compute service"):
        submit(engine, PROMPTS[0])
    assert cache.tables == {}, "the live cache freed the failed requests' blocks"
    compute.down = False
    for _ in range(100):
        if engine.attached_epoch() is not None:
            break
        threading.Event().wait(0.05)
    assert collect(submit(engine, PROMPTS[0])) == reference[0]


def test_an_exception_in_one_step_fails_only_its_request_with_internal(start, reference):
    engine, cache, _ = start(step_hook="tests.step_hooks:FailStep=bad")
    error = collect(submit(engine, PROMPTS[1], request_id="bad"))
    assert isinstance(error, PagedServeError) and error.code == grpc.StatusCode.INTERNAL
    assert "RuntimeError" in str(error) and "request bad" in str(error)
    assert cache.tables == {}
    assert run_all(engine) == reference
    assert_nothing_held(engine, cache)


def test_a_dead_loop_fails_every_request_fast_and_refuses_new_ones(start, monkeypatch):
    engine, _, compute = start()
    compute.before[1] = lambda: monkeypatch.setattr(engine.scheduler, "add", _raise)
    first = submit(engine, PROMPTS[0])
    assert collect(first) and isinstance(collect(submit(engine, PROMPTS[1])), Unavailable)
    assert engine.dead is not None and engine.attached_epoch() is None
    with pytest.raises(Unavailable, match="engine stopped"):
        submit(engine, PROMPTS[2])


def test_stop_ends_waiting_requests_at_once(start):
    engine, _, compute = start()
    compute.down = True
    seq = submit(engine, PROMPTS[0])
    engine.stop()
    assert isinstance(collect(seq, timeout=2), Unavailable)


def _raise(*_):
    raise IndexError("packing went wrong")


def test_recovery_retries_with_backoff_and_expires_once():
    now = [0.0]
    recovery = PeerRecovery(3.0, {"cache": CACHE, "compute": COMPUTE}, clock=lambda: now[0])
    assert not recovery.active and recovery.expire() is None
    recovery.lost("compute")
    assert recovery.active and recovery.retry_in() == 0
    delays = []
    for _ in range(6):
        recovery.failed("cache")
        delays.append(recovery.retry_in())
    assert delays == [min(FIRST_DELAY_S * 2**i, MAX_DELAY_S) for i in range(6)]
    assert delays[-1] == MAX_DELAY_S > delays[0]
    now[0] = 2.9
    assert recovery.expire() is None
    now[0] = 3.0
    error = recovery.expire()
    assert isinstance(error, Unavailable) and str(error).startswith(
        f"cache service at {CACHE} unreachable for 3 s"
    )
    assert recovery.expired and recovery.expire() is None
    recovery.recovered()
    assert not recovery.active and not recovery.expired


@pytest.mark.parametrize(
    ("code", "details", "lost"),
    [
        (grpc.StatusCode.UNAVAILABLE, "connection refused", True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", True),
        (grpc.StatusCode.FAILED_PRECONDITION, "no KV pool attached", True),
        (grpc.StatusCode.FAILED_PRECONDITION, "stale pool epoch 'a'", True),
        (grpc.StatusCode.INVALID_ARGUMENT, "token id 5 is outside the vocabulary", False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "not enough blocks", False),
    ],
)
def test_which_failures_mean_a_lost_peer(code, details, lost):
    assert PeerFault("compute", RpcError(code, details)).lost == lost


def test_step_deadline_is_fixed_or_derived_from_recent_steps():
    assert StepDeadline(2.5, cold_s=120).timeout(1000) == 2.5
    deadline = StepDeadline(0, cold_s=120)
    assert deadline.timeout(1) == 120, "no history yet: the RPC timeout"
    for _ in range(WARMUP):
        deadline.observe(0.1, 10)
    assert deadline.timeout(10) == FLOOR_S
    assert deadline.timeout(10_000) == pytest.approx(10 * 0.01 * 10_000), "a long chunk gets its due"
    deadline.observe(2.0, 10)
    assert deadline.timeout(10) == pytest.approx(20.0), "the p99 step, times 10"


def test_streams_beyond_the_cap_are_refused_at_once():
    slots = StreamSlots(2)
    assert slots.server_threads == 2 + SPARE_THREADS
    refused = pytest.raises(PagedServeError, match=r"too many concurrent streams \(2\); retry")
    with slots.hold(), slots.hold(), refused as info, slots.hold():
        pass
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with slots.hold():
        pass
