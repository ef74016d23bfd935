"""Cache sessions (leases) on the cache servicer, in process, with a fake clock: a lapse frees exactly that
session's sequences (written full blocks stay cached), sessions never touch each other's sequences, and a
lapsed session is told so."""

import glob
import os

import pytest
import structlog

from cache_service.servicer import CacheServicer
from cache_service.sessions import REMEMBERED_LAPSED, Sessions
from common.errors import FailedPrecondition, InvalidArgument, NotFound
from protos import cache_pb2

BLOCK_SIZE, NUM_BLOCKS, DEFAULT_TTL, MAX_TTL = 4, 32, 2.0, 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def cache(clock):
    servicer = CacheServicer(
        "freelist", NUM_BLOCKS, 0, structlog.get_logger(), sessions=Sessions(DEFAULT_TTL, MAX_TTL, clock)
    )
    geometry = cache_pb2.PoolGeometry(num_layers=1, num_kv_heads=1, head_dim=4)
    servicer.CreatePool(
        cache_pb2.CreatePoolRequest(geometry=geometry, block_size=BLOCK_SIZE, kv_dtype="float32"), None
    )
    try:
        yield servicer
    finally:
        servicer.close()
        assert not glob.glob(f"/dev/shm/pagedserve-*-{os.getpid()}-*"), "segment and fence removed"


def open_session(cache, session_id: str, ttl_s: float = 0.0) -> cache_pb2.Session:
    return cache.OpenSession(cache_pb2.OpenSessionRequest(session_id=session_id, ttl_s=ttl_s), None)


def admit(cache, session_id: str, seq_id: str, tokens: list[int]) -> cache_pb2.BlockTables:
    seq = cache_pb2.SequenceRequest(seq_id=seq_id, num_tokens=len(tokens), token_ids=tokens)
    return cache.Reserve(cache_pb2.ReserveRequest(new_seqs=[seq], session_id=session_id), None)


def progress(cache, session_id: str, seq_id: str, new_tokens: list[int], num_tokens: int, num_computed: int):
    seq = cache_pb2.SequenceRequest(
        seq_id=seq_id, num_tokens=num_tokens, token_ids=new_tokens, num_computed=num_computed
    )
    cache.Reserve(cache_pb2.ReserveRequest(running_seqs=[seq], session_id=session_id), None)


def stats(cache) -> cache_pb2.CacheStats:
    return cache.GetStats(cache_pb2.GetStatsRequest(), None)


def check(cache) -> None:
    cache._pool.blocks.check_invariants()


def test_a_lapse_frees_exactly_that_sessions_sequences_and_keeps_written_blocks_cached(cache, clock):
    open_session(cache, "a")
    open_session(cache, "b", ttl_s=4.0)
    prompt = list(range(10))  # 3 blocks: 2 full, 1 partial
    admit(cache, "a", "a1", prompt)
    progress(cache, "a", "a1", [10], 11, 10)  # both full blocks written, a 3rd block's worth still partial
    admit(cache, "b", "b1", [50 + i for i in range(6)])
    assert (stats(cache).used_blocks, stats(cache).num_sessions) == (5, 2)

    clock.now += DEFAULT_TTL + 0.1  # past a's TTL, within b's
    cache.sweep()
    after = stats(cache)
    assert (after.num_sequences, after.used_blocks, after.cached_blocks, after.num_sessions) == (1, 2, 2, 1)
    check(cache)
    # a's two written full blocks are found by the next prompt that starts with them
    (table,) = admit(cache, "b", "b2", prompt).tables
    assert table.cached_tokens == 8
    check(cache)


def test_renewal_keeps_a_session_and_late_calls_of_a_lapsed_one_are_told_it_expired(cache, clock):
    open_session(cache, "a")
    admit(cache, "a", "a1", [1, 2, 3])
    for _ in range(4):
        clock.now += DEFAULT_TTL * 0.75
        renewed = cache.RenewSession(cache_pb2.RenewSessionRequest(session_id="a"), None)
        assert (renewed.ttl_s, renewed.num_sequences) == (DEFAULT_TTL, 1)
    clock.now += DEFAULT_TTL + 0.1
    with pytest.raises(
        FailedPrecondition, match="session 'a' expired: its sequences were freed; re-register"
    ):
        cache.RenewSession(cache_pb2.RenewSessionRequest(session_id="a"), None)
    with pytest.raises(FailedPrecondition, match="expired"):
        progress(cache, "a", "a1", [4], 4, 3)
    assert stats(cache).used_blocks == 0
    closed = cache.CloseSession(cache_pb2.CloseSessionRequest(session_id="a"), None)
    assert (closed.num_sequences, closed.freed_blocks) == (0, 0), "a lapsed session closes, freeing nothing"
    # re-registering starts the session afresh, holding nothing
    assert open_session(cache, "a").num_sequences == 0
    admit(cache, "a", "a1", [1, 2, 3])
    assert stats(cache).num_sequences == 1
    check(cache)


def test_sessions_never_touch_each_others_sequences(cache):
    open_session(cache, "a")
    open_session(cache, "b")
    admit(cache, "a", "a1", [1, 2, 3, 4, 5])
    before = stats(cache)
    with pytest.raises(NotFound, match=r"\['a1'\] have no block table in session 'b'"):
        progress(cache, "b", "a1", [6], 6, 5)
    with pytest.raises(NotFound, match="session 'b'"):
        cache.Free(cache_pb2.FreeRequest(seq_ids=["a1"], session_id="b"), None)
    with pytest.raises(NotFound, match="session 'b'"):
        cache.Fork(cache_pb2.ForkRequest(parent_id="a1", child_ids=["b2"], session_id="b"), None)
    with pytest.raises(NotFound, match="session ''"):
        cache.Free(cache_pb2.FreeRequest(seq_ids=["a1"]), None)
    assert stats(cache) == before
    # b closing frees nothing of a's
    closed = cache.CloseSession(cache_pb2.CloseSessionRequest(session_id="b"), None)
    assert (closed.num_sequences, stats(cache).num_sequences) == (0, 1)
    check(cache)


def test_forked_children_belong_to_the_parents_session_and_close_frees_them_all(cache):
    open_session(cache, "a")
    admit(cache, "a", "p", [1, 2, 3, 4, 5, 6])
    cache.Fork(cache_pb2.ForkRequest(parent_id="p", child_ids=["p/1", "p/2"], session_id="a"), None)
    cache.Free(cache_pb2.FreeRequest(seq_ids=["p/2"], session_id="a"), None)
    assert open_session(cache, "a").num_sequences == 2
    closed = cache.CloseSession(cache_pb2.CloseSessionRequest(session_id="a"), None)
    assert (closed.num_sequences, closed.freed_blocks) == (2, 2)
    assert (stats(cache).used_blocks, stats(cache).num_sessions) == (0, 0)
    with pytest.raises(FailedPrecondition, match="unknown session 'a': OpenSession first"):
        admit(cache, "a", "q", [1])
    with pytest.raises(NotFound, match="no session 'a' to close: it was never opened, is closed already"):
        cache.CloseSession(cache_pb2.CloseSessionRequest(session_id="a"), None)
    check(cache)


def test_unleased_sequences_never_lapse_and_sessions_cannot_touch_them(cache, clock):
    admit(cache, "", "u", [1, 2, 3])
    open_session(cache, "a")
    with pytest.raises(NotFound, match="session 'a'"):
        cache.Free(cache_pb2.FreeRequest(seq_ids=["u"], session_id="a"), None)
    clock.now += 1000.0
    cache.sweep()
    assert (stats(cache).num_sequences, stats(cache).num_sessions) == (1, 0)
    cache.Free(cache_pb2.FreeRequest(seq_ids=["u"]), None)
    check(cache)


def test_ttl_defaults_is_capped_and_must_be_a_nonnegative_number(cache):
    assert open_session(cache, "a").ttl_s == DEFAULT_TTL
    assert open_session(cache, "b", ttl_s=1.5).ttl_s == 1.5
    assert open_session(cache, "c", ttl_s=MAX_TTL * 10).ttl_s == MAX_TTL
    for ttl in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="ttl_s must be >= 0"):
            open_session(cache, "d", ttl_s=ttl)
    with pytest.raises(InvalidArgument, match="session_id must not be empty"):
        open_session(cache, "")
    assert stats(cache).num_sessions == 3


def test_a_refused_reserve_records_nothing(cache):
    open_session(cache, "a")
    too_long = cache_pb2.SequenceRequest(seq_id="x", num_tokens=NUM_BLOCKS * BLOCK_SIZE + 1)
    with pytest.raises(Exception, match="blocks"):
        cache.Reserve(cache_pb2.ReserveRequest(new_seqs=[too_long], session_id="a"), None)
    assert open_session(cache, "a").num_sequences == 0
    check(cache)


def test_lapsed_ids_are_remembered_up_to_a_bound():
    clock = Clock()
    sessions = Sessions(1.0, 1.0, clock)
    for index in range(REMEMBERED_LAPSED + 1):
        sessions.open(f"s{index}", 0.0)
    clock.now += 2.0
    assert len(sessions.sweep(None)) == REMEMBERED_LAPSED + 1
    with pytest.raises(FailedPrecondition, match="unknown session 's0'"):
        sessions.renew("s0")
    with pytest.raises(FailedPrecondition, match="session 's1' expired"):
        sessions.renew("s1")
