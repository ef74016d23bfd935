"""The gateway's lease: opened with a fresh session id each time, renewed every TTL/3, a lost session
reported once, other renewal failures retried sooner; the KV view names the session in every call, and a
lost session's sequences are requeued without a Free."""

import threading
import time

import grpc

from gateway.kv_view import KVView
from gateway.lease import Lease, is_lost
from protos import cache_pb2
from tests.fake_cache import FakeCache
from tests.fake_peers import RpcError as Status
from tests.scheduling import make, run, seq


class FakeSessions:
    """OpenSession grants the TTL asked; RenewSession answers with the queued errors first."""

    def __init__(self, errors: list[grpc.RpcError] = ()) -> None:
        self.errors = list(errors)
        self.calls: list[tuple[str, str]] = []
        self.renewed = threading.Event()

    def OpenSession(self, request: cache_pb2.OpenSessionRequest, **_) -> cache_pb2.Session:
        self.calls.append(("open", request.session_id))
        return cache_pb2.Session(session_id=request.session_id, ttl_s=request.ttl_s)

    def RenewSession(self, request: cache_pb2.RenewSessionRequest, **_) -> cache_pb2.Session:
        self.calls.append(("renew", request.session_id))
        if self.errors:
            raise self.errors.pop(0)
        self.renewed.set()
        return cache_pb2.Session(session_id=request.session_id)

    def CloseSession(self, request: cache_pb2.CloseSessionRequest, **_) -> cache_pb2.CloseSessionResponse:
        self.calls.append(("close", request.session_id))
        return cache_pb2.CloseSessionResponse()


EXPIRED = Status(grpc.StatusCode.FAILED_PRECONDITION, "session 'x' expired: its sequences were freed")


def test_only_a_failed_precondition_naming_the_session_is_a_loss():
    assert is_lost(EXPIRED)
    assert not is_lost(Status(grpc.StatusCode.FAILED_PRECONDITION, "no pool: call CreatePool first"))
    assert not is_lost(Status(grpc.StatusCode.UNAVAILABLE, "session unreachable"))


def test_a_lease_renews_every_third_of_its_ttl_retries_unavailable_and_closes():
    stub = FakeSessions([Status(grpc.StatusCode.UNAVAILABLE, "down")])
    lost = []
    lease = Lease(stub, 0.3, lambda: lost.append(1))
    lease.open()
    assert stub.renewed.wait(2.0)
    lease.close()
    renewals = [call for call in stub.calls if call[0] == "renew"]
    assert len(renewals) >= 2 and {session_id for _, session_id in renewals} == {lease.session_id}
    assert stub.calls[0] == ("open", lease.session_id) and stub.calls[-1] == ("close", lease.session_id)
    assert lost == []


def test_a_lost_session_is_reported_once_and_reopening_takes_a_fresh_id():
    stub = FakeSessions([EXPIRED])
    lost = threading.Event()
    lease = Lease(stub, 0.15, lost.set)
    lease.open()
    first = lease.session_id
    assert lost.wait(2.0)
    time.sleep(0.2)  # no renewal of the lost session, and no second report
    assert [call for call in stub.calls if call[0] == "renew"] == [("renew", first)]
    lease.open()
    assert lease.session_id != first and ("close", first) in stub.calls  # its sequence ids are free again
    assert stub.renewed.wait(2.0)
    lease.close()


def test_a_lease_whose_renewals_fail_for_a_ttl_is_no_longer_held():
    stub = FakeSessions([Status(grpc.StatusCode.UNAVAILABLE, "down")] * 100)
    lease = Lease(stub, 0.3, lambda: None)
    lease.open()
    assert lease.held()
    time.sleep(0.45)
    assert not lease.held()
    lease.close()


def test_the_kv_view_names_the_session_and_a_lost_one_requeues_its_sequences_without_a_free():
    scheduler = make(block_size=4, num_blocks=32, max_batched_tokens=64, max_seqs=8)
    cache = scheduler.kv._stub
    lease = Lease(FakeSessions(), 10.0, lambda: None)
    lease.session_id = "s1"
    recording = _Recording(cache)
    scheduler.kv = kv = KVView(recording, 4, 32, lease=lease)
    a, b = seq("a", 6), seq("b", 9)
    scheduler.add(a)
    scheduler.add(b)
    run(scheduler, scheduler.schedule())
    run(scheduler, scheduler.schedule())
    assert kv.holds(a) and a.output_ids
    held = dict(cache.tables)

    running = list(scheduler.running)
    scheduler.requeue_running()
    kv.forget(running)
    assert [s.seq_id for s in running] == ["a", "b"] and scheduler.waiting == running
    assert not kv.holds(a) and (a.num_computed, b.num_computed) == (0, 0)
    assert cache.calls.count("Free") == 0 and cache.tables == held  # the cache service frees them itself
    assert recording.sessions == {"s1"}


class _Recording:
    """Passes calls to a FakeCache, recording the session each names."""

    def __init__(self, cache: FakeCache) -> None:
        self._cache, self.sessions = cache, set()

    def __getattr__(self, name: str):
        def call(request, **kwargs):
            self.sessions.add(request.session_id)
            return getattr(self._cache, name)(request, **kwargs)

        return call
