"""The cache service as a real process, over gRPC: pool segment, block tables, errors, shutdown."""

import os
import stat
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from common.segment_header import HEADER_BYTES, TOKEN_BYTES
from common.shared_pool import open_pool
from common.shm_files import SEGMENT_PREFIX, SHM_DIR
from protos import cache_pb2
from tests.e2e.cache_process import BLOCK_SIZE, HEAD_DIM, HEADS, LAYERS, Service, pool_request, refused, seqs

pytestmark = pytest.mark.e2e

NUM_BLOCKS = 64
BLOCK_BYTES = LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4  # float32, every layer, K and V


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    service = Service(tmp_path_factory.mktemp("cache"), "--kv-blocks", str(NUM_BLOCKS), "--debug-read-kv")
    yield service
    service.stop()


@pytest.fixture(scope="module")
def handle(service):
    return service.stub.CreatePool(pool_request())


@pytest.fixture
def stub(service, handle):
    """The module's service with its pool; checks each test left no sequence behind."""
    yield service.stub
    assert service.stats().num_sequences == 0


def test_create_pool_returns_a_private_fully_sized_segment_with_its_header(service, handle):
    assert handle.device == "cpu"
    assert list(handle.shape) == [LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM]
    assert handle.dtype == "float32"
    assert list(handle.strides) == list(torch.empty(list(handle.shape)).stride())
    path = Path(handle.shm.path)
    assert path.parent == SHM_DIR and path.name.startswith(f"{SEGMENT_PREFIX}{service.proc.pid}-")
    info = path.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert handle.shm.nbytes == NUM_BLOCKS * BLOCK_BYTES and info.st_size == handle.shm.nbytes + HEADER_BYTES
    assert info.st_blocks * 512 >= info.st_size, "the segment must be fully backed, not sparse"
    assert len(handle.shm.token) == TOKEN_BYTES


def test_create_pool_again_returns_the_same_pool(service, handle):
    again = service.stub.CreatePool(pool_request())
    assert again == handle
    assert service.stub.CreatePool(pool_request(num_blocks=NUM_BLOCKS)) == handle, "the live pool's size"
    details = refused(
        service.stub.CreatePool, pool_request(num_blocks=8), grpc.StatusCode.FAILED_PRECONDITION
    )
    assert f"holds a pool of {NUM_BLOCKS} blocks" in details and "asked for 8 blocks" in details
    assert "send no num_blocks or memory_bytes to use the live pool" in details
    memory = pool_request(memory_bytes=(NUM_BLOCKS + 1) * BLOCK_BYTES)
    assert f"asked for {NUM_BLOCKS + 1} blocks" in refused(
        service.stub.CreatePool, memory, grpc.StatusCode.FAILED_PRECONDITION
    )
    assert service.stats().total_blocks == NUM_BLOCKS


def test_allocate_extend_free_round_trip(stub, handle, service):
    reply = stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("a", 1), ("b", 17), ("c", 32))))
    assert [table.seq_id for table in reply.tables] == ["a", "b", "c"]
    assert [len(table.block_ids) for table in reply.tables] == [1, 2, 2]
    assert [table.cached_tokens for table in reply.tables] == [0, 0, 0]
    held = [block_id for table in reply.tables for block_id in table.block_ids]
    assert len(set(held)) == 5 and all(0 <= block_id < NUM_BLOCKS for block_id in held)
    assert reply.available_blocks == NUM_BLOCKS - 5
    a, b = list(reply.tables[0].block_ids), list(reply.tables[1].block_ids)

    grown = stub.Reserve(cache_pb2.ReserveRequest(running_seqs=seqs(("b", 33), ("a", 16))))
    assert [table.seq_id for table in grown.tables] == ["b", "a"]
    assert list(grown.tables[0].block_ids[:2]) == b and len(grown.tables[0].block_ids) == 3
    assert list(grown.tables[1].block_ids) == a
    assert grown.available_blocks == NUM_BLOCKS - 6

    stats = service.stats()
    assert (stats.total_blocks, stats.used_blocks, stats.free_blocks) == (NUM_BLOCKS, 6, NUM_BLOCKS - 6)
    assert (stats.num_sequences, stats.block_size, stats.cached_blocks) == (3, BLOCK_SIZE, 0)
    assert stats.usage == pytest.approx(6 / NUM_BLOCKS)
    assert (stats.allocator, stats.pool_epoch) == ("freelist", handle.epoch)

    freed = stub.Free(cache_pb2.FreeRequest(seq_ids=["a", "b", "c"]))
    assert (freed.freed_blocks, freed.available_blocks) == (6, NUM_BLOCKS)
    assert service.stats().used_blocks == 0


def test_reserve_allocates_and_extends_in_one_call_and_refuses_as_a_whole(stub, service):
    stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("run", 16))))
    request = cache_pb2.ReserveRequest(new_seqs=seqs(("new", 20)), running_seqs=seqs(("run", 17)))
    reply = stub.Reserve(request)
    assert [(t.seq_id, len(t.block_ids)) for t in reply.tables] == [("new", 2), ("run", 2)]
    assert reply.available_blocks == NUM_BLOCKS - 4
    run = list(reply.tables[1].block_ids)
    # once 17 tokens are written, a step to 40 tokens can only touch the blocks from the second on
    grow = cache_pb2.SequenceRequest(seq_id="run", num_tokens=40, token_ids=[], num_computed=17)
    tail = stub.Reserve(cache_pb2.ReserveRequest(running_seqs=[grow])).tables[0]
    assert (tail.first_block, len(tail.block_ids)) == (1, 2) and tail.block_ids[0] == run[1]
    assert service.stats().free_blocks == reply.available_blocks - 1
    too_big = cache_pb2.ReserveRequest(
        new_seqs=seqs(("big", NUM_BLOCKS * BLOCK_SIZE)), running_seqs=seqs(("run", 41))
    )
    details = refused(stub.Reserve, too_big, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert f"need {NUM_BLOCKS} blocks, {NUM_BLOCKS - 5} free" in details
    unknown = cache_pb2.ReserveRequest(new_seqs=seqs(("other", 4)), running_seqs=seqs(("ghost", 4)))
    assert "'ghost'" in refused(stub.Reserve, unknown, grpc.StatusCode.NOT_FOUND)
    stats = service.stats()
    assert (stats.used_blocks, stats.num_sequences) == (5, 2), "a refused Reserve changes nothing"
    stub.Free(cache_pb2.FreeRequest(seq_ids=["new", "run"]))
    assert service.stats().used_blocks == 0


def test_exhaustion_is_refused_with_the_numbers_and_changes_nothing(stub, service):
    big = stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("big", 60 * BLOCK_SIZE)))).tables[0]
    details = refused(
        stub.Reserve,
        cache_pb2.ReserveRequest(new_seqs=seqs(("x", 1), ("y", 10 * BLOCK_SIZE))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    assert "need 11 blocks, 4 free of 64" in details
    assert service.stats().used_blocks == 60
    refused(stub.Free, cache_pb2.FreeRequest(seq_ids=["x"]), grpc.StatusCode.NOT_FOUND)

    details = refused(
        stub.Reserve,
        cache_pb2.ReserveRequest(running_seqs=seqs(("big", 65 * BLOCK_SIZE))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    assert "need 5 blocks, 4 free of 64" in details
    same = stub.Reserve(cache_pb2.ReserveRequest(running_seqs=seqs(("big", 60 * BLOCK_SIZE)))).tables[0]
    assert same.block_ids == big.block_ids
    assert stub.Free(cache_pb2.FreeRequest(seq_ids=["big"])).freed_blocks == 60


@pytest.mark.parametrize(
    ("rpc", "request_", "code", "message"),
    [
        ("Reserve", cache_pb2.ReserveRequest(running_seqs=seqs(("ghost", 4))), "NOT_FOUND", "'ghost'"),
        ("Free", cache_pb2.FreeRequest(seq_ids=["ghost"]), "NOT_FOUND", "'ghost'"),
        (
            "Reserve",
            cache_pb2.ReserveRequest(new_seqs=seqs(("n", 0))),
            "INVALID_ARGUMENT",
            "num_tokens must be > 0",
        ),
        (
            "Reserve",
            cache_pb2.ReserveRequest(new_seqs=seqs(("n", 1), ("n", 1))),
            "ALREADY_EXISTS",
            "twice",
        ),
        ("CreatePool", cache_pb2.CreatePoolRequest(), "INVALID_ARGUMENT", "geometry.num_layers must be > 0"),
        ("CreatePool", pool_request(block_size=2048), "INVALID_ARGUMENT", "block_size must be in 1..1024"),
        (
            "CreatePool",
            pool_request(memory_bytes=100),
            "RESOURCE_EXHAUSTED",
            f"one block takes {BLOCK_BYTES} bytes",
        ),
        (
            "ReadBlock",
            cache_pb2.ReadBlockRequest(block_id=NUM_BLOCKS),
            "INVALID_ARGUMENT",
            "the pool has 64 blocks",
        ),
        ("ReadBlock", cache_pb2.ReadBlockRequest(layer=LAYERS), "INVALID_ARGUMENT", "the pool has 2 layers"),
    ],
)
def test_errors_carry_their_status_code_and_message(stub, handle, service, rpc, request_, code, message):
    details = refused(getattr(stub, rpc), request_, getattr(grpc.StatusCode, code))
    assert message in details
    assert service.stats().pool_epoch == handle.epoch


def test_create_pool_bad_dtype_is_refused(stub):
    request = pool_request()
    request.kv_dtype = "int8"
    assert "unsupported dtype 'int8'" in refused(stub.CreatePool, request, grpc.StatusCode.INVALID_ARGUMENT)


def test_free_with_an_unknown_id_frees_nothing(stub, service):
    stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("keep", 20))))
    refused(stub.Free, cache_pb2.FreeRequest(seq_ids=["keep", "ghost"]), grpc.StatusCode.NOT_FOUND)
    assert (service.stats().used_blocks, service.stats().num_sequences) == (2, 1)
    assert stub.Free(cache_pb2.FreeRequest(seq_ids=["keep"])).freed_blocks == 2


def test_new_layout_is_refused_while_sequences_hold_blocks(stub, handle, service):
    stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("held", 1))))
    details = refused(stub.CreatePool, pool_request(block_size=32), grpc.StatusCode.FAILED_PRECONDITION)
    assert "restart the cache service to change the layout" in details
    assert (service.stats().pool_epoch, service.stats().block_size) == (handle.epoch, BLOCK_SIZE)
    stub.Free(cache_pb2.FreeRequest(seq_ids=["held"]))


def test_sessions_over_grpc_refuse_each_others_sequences_and_a_lapsed_one_is_told(stub, service):
    stub.OpenSession(cache_pb2.OpenSessionRequest(session_id="b"))
    granted = stub.OpenSession(cache_pb2.OpenSessionRequest(session_id="a", ttl_s=0.5))
    assert (granted.ttl_s, service.stats().num_sessions) == (0.5, 2)
    stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("a1", 20)), session_id="a"))
    foreign = cache_pb2.FreeRequest(seq_ids=["a1"], session_id="b")
    assert "session 'b'" in refused(stub.Free, foreign, grpc.StatusCode.NOT_FOUND)
    time.sleep(1.5)  # no renewal: the sweep lapses a within about a second
    assert (service.stats().used_blocks, service.stats().num_sessions) == (0, 1)
    details = refused(
        stub.RenewSession, cache_pb2.RenewSessionRequest(session_id="a"), grpc.StatusCode.FAILED_PRECONDITION
    )
    assert "session 'a' expired: its sequences were freed; re-register" in details
    assert stub.CloseSession(cache_pb2.CloseSessionRequest(session_id="b")).num_sequences == 0
    unknown = cache_pb2.CloseSessionRequest(session_id="b")
    assert "no session 'b' to close" in refused(stub.CloseSession, unknown, grpc.StatusCode.NOT_FOUND)
    assert "session_lapsed" in service.log()


def test_read_block_sees_what_another_process_wrote(stub, handle):
    (table,) = stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("r", 1)))).tables
    block_id = table.block_ids[0]
    shape = [2, BLOCK_SIZE, HEADS, HEAD_DIM]

    fresh = stub.ReadBlock(cache_pb2.ReadBlockRequest(block_id=block_id, layer=1, include_data=True))
    assert (fresh.block_id, fresh.refcount, fresh.dtype, list(fresh.shape)) == (block_id, 1, "float32", shape)
    assert fresh.data == bytes(BLOCK_BYTES // LAYERS)

    pool = open_pool(handle)
    written = torch.arange(2 * BLOCK_SIZE * HEADS * HEAD_DIM, dtype=torch.float32).view(shape)
    written[1] *= -1
    pool[1, :, block_id] = written
    try:
        read = stub.ReadBlock(cache_pb2.ReadBlockRequest(block_id=block_id, layer=1, include_data=True))
        assert torch.equal(torch.frombuffer(bytearray(read.data), dtype=torch.float32).view(shape), written)
        other_layer = stub.ReadBlock(
            cache_pb2.ReadBlockRequest(block_id=block_id, layer=0, include_data=True)
        )
        assert other_layer.data == bytes(BLOCK_BYTES // LAYERS)
        meta = stub.ReadBlock(cache_pb2.ReadBlockRequest(block_id=block_id, layer=1))
        assert (meta.data, meta.refcount) == (b"", 1)
    finally:
        pool[1, :, block_id] = 0
        stub.Free(cache_pb2.FreeRequest(seq_ids=["r"]))
    assert stub.ReadBlock(cache_pb2.ReadBlockRequest(block_id=block_id)).refcount == 0


# fresh processes: start-up, the state before CreatePool, keeping the pool's layout, shutdown


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_start_sweeps_stale_segments_and_refuses_calls_before_create_pool(tmp_path):
    stale = SHM_DIR / f"{SEGMENT_PREFIX}{dead_pid()}-{uuid.uuid4().hex}"
    live = SHM_DIR / f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    try:
        service = Service(tmp_path)
        try:
            assert not stale.exists()
            assert live.exists(), "a segment whose owner is alive must stay"
            assert str(stale) in service.log()
            stub = service.stub
            for call, request in [
                (stub.Reserve, cache_pb2.ReserveRequest(running_seqs=seqs(("a", 1)))),
                (stub.Reserve, cache_pb2.ReserveRequest(new_seqs=seqs(("a", 1)))),
                (stub.Free, cache_pb2.FreeRequest(seq_ids=["a"])),
                (stub.ReadBlock, cache_pb2.ReadBlockRequest()),
            ]:
                details = refused(call, request, grpc.StatusCode.FAILED_PRECONDITION)
                assert details == "no pool: call CreatePool first"
            stats = service.stats()
            assert (stats.total_blocks, stats.pool_epoch, stats.allocator) == (0, "", "freelist")
        finally:
            service.stop()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def test_an_idle_pool_keeps_its_layout_and_sigterm_unlinks_it(tmp_path):
    service = Service(tmp_path, "--kv-memory", "1MiB")
    try:
        first = service.stub.CreatePool(pool_request(num_blocks=10))
        assert service.stats().total_blocks == 10
        details = refused(
            service.stub.CreatePool, pool_request(block_size=32), grpc.StatusCode.FAILED_PRECONDITION
        )
        assert "block_size 16" in details and "block_size 32" in details
        assert Path(first.shm.path).exists()
        stats = service.stats()
        assert (stats.total_blocks, stats.block_size, stats.pool_epoch) == (10, BLOCK_SIZE, first.epoch)
    finally:
        assert service.stop() == 0
    assert not Path(first.shm.path).exists()
    assert "pool_released" in service.log()


def test_lookup_finds_a_prompts_cached_prefix_over_grpc_and_refuses_bad_counts(stub, service):
    prompt = list(range(100, 100 + 3 * BLOCK_SIZE + 5))
    request = cache_pb2.SequenceRequest(seq_id="p", num_tokens=len(prompt), token_ids=prompt)
    assert list(stub.Lookup(cache_pb2.LookupRequest(seqs=[request])).cached_tokens) == [0]
    stub.Reserve(cache_pb2.ReserveRequest(new_seqs=[request]))
    stub.Free(cache_pb2.FreeRequest(seq_ids=["p"], num_computed={"p": len(prompt)}))
    other = cache_pb2.SequenceRequest(seq_id="o", num_tokens=4, token_ids=[1, 2, 3, 4])
    reply = stub.Lookup(cache_pb2.LookupRequest(seqs=[request, other]))
    assert list(reply.cached_tokens) == [3 * BLOCK_SIZE, 0] and reply.available_blocks == NUM_BLOCKS
    capped = cache_pb2.SequenceRequest(
        seq_id="q", num_tokens=len(prompt), token_ids=prompt, max_compute_tokens=2
    )
    (table,) = stub.Reserve(cache_pb2.ReserveRequest(new_seqs=[capped])).tables
    assert (table.cached_tokens, table.num_tokens) == (3 * BLOCK_SIZE, 3 * BLOCK_SIZE + 2)
    stub.Free(cache_pb2.FreeRequest(seq_ids=["q"]))
    bad = cache_pb2.SequenceRequest(seq_id="b", num_tokens=9, token_ids=[1, 2])
    assert "give every token or none" in refused(
        stub.Lookup, cache_pb2.LookupRequest(seqs=[bad]), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert service.stats().used_blocks == 0


def test_lookup_indexes_the_running_progress_first_and_names_the_hit_blocks(stub, service):
    prompt = list(range(500, 500 + 3 * BLOCK_SIZE + 5))
    request = cache_pb2.SequenceRequest(seq_id="w", num_tokens=len(prompt), token_ids=prompt)
    (table,) = stub.Reserve(cache_pb2.ReserveRequest(new_seqs=[request])).tables
    query = cache_pb2.SequenceRequest(seq_id="q", num_tokens=len(prompt), token_ids=prompt)
    reply = stub.Lookup(cache_pb2.LookupRequest(seqs=[query]))
    assert list(reply.cached_tokens) == [0], "nothing reported written yet"
    reply = stub.Lookup(cache_pb2.LookupRequest(seqs=[query], num_computed={"w": 2 * BLOCK_SIZE + 1}))
    assert list(reply.cached_tokens) == [2 * BLOCK_SIZE]
    assert list(reply.prefix_blocks[0].block_ids) == list(table.block_ids[:2]), "w's own blocks: held"
    for progress, code in (
        ({"nobody": 4}, grpc.StatusCode.NOT_FOUND),
        ({"w": -1}, grpc.StatusCode.INVALID_ARGUMENT),
    ):
        refused(stub.Lookup, cache_pb2.LookupRequest(seqs=[query], num_computed=progress), code)
    stub.Free(cache_pb2.FreeRequest(seq_ids=["w"]))
    assert service.stats().used_blocks == 0


def test_reserve_with_lookahead_grows_the_table_ahead_and_refuses_a_bad_value(stub, service):
    stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("la", BLOCK_SIZE))))

    def step(num_tokens: int, num_computed: int, lookahead: int = 0) -> cache_pb2.BlockTables:
        seq = cache_pb2.SequenceRequest(
            seq_id="la", num_tokens=num_tokens, num_computed=num_computed, lookahead_tokens=lookahead
        )
        return cache_pb2.ReserveRequest(running_seqs=[seq])

    ahead = stub.Reserve(step(BLOCK_SIZE, BLOCK_SIZE, lookahead=BLOCK_SIZE))
    (tail,) = ahead.tables
    assert (tail.first_block, len(tail.block_ids)) == (1, 1), "the lookahead block, past the full first one"
    assert ahead.available_blocks == NUM_BLOCKS - 2
    grown = stub.Reserve(step(2 * BLOCK_SIZE, BLOCK_SIZE + 1))
    assert list(grown.tables[0].block_ids) == list(tail.block_ids), "growing into it takes no block"
    assert grown.available_blocks == NUM_BLOCKS - 2
    before = service.stats()
    for request, message in (
        (
            step(2 * BLOCK_SIZE, 2 * BLOCK_SIZE, lookahead=-1),
            "'la': lookahead_tokens must be in [0, 64], got -1",
        ),
        (
            step(2 * BLOCK_SIZE, 2 * BLOCK_SIZE, lookahead=65),
            "'la': lookahead_tokens must be in [0, 64], got 65",
        ),
        (
            cache_pb2.ReserveRequest(
                new_seqs=[cache_pb2.SequenceRequest(seq_id="n", num_tokens=4, lookahead_tokens=4)],
                running_seqs=step(2 * BLOCK_SIZE, 2 * BLOCK_SIZE, lookahead=8).running_seqs,
            ),
            "'n': lookahead_tokens must be 0 for a new sequence (running sequences take [0, 64]), got 4",
        ),
    ):
        assert message in refused(stub.Reserve, request, grpc.StatusCode.INVALID_ARGUMENT)
    assert service.stats() == before, "a refused Reserve changes nothing"
    freed = stub.Free(cache_pb2.FreeRequest(seq_ids=["la"]))
    assert (freed.freed_blocks, freed.available_blocks) == (2, NUM_BLOCKS)


def test_a_sliding_window_pool_releases_the_blocks_before_the_window(tmp_path):
    windowed = Service(tmp_path, "--kv-blocks", "16")
    try:
        stub = windowed.stub
        stub.CreatePool(pool_request(sliding_windows=[20, 20]))
        assert (windowed.stats().sliding_window, windowed.stats().used_blocks) == (20, 1), "the null block"
        stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("a", 40))))
        grown = cache_pb2.SequenceRequest(seq_id="a", num_tokens=100, num_computed=40)
        stub.Reserve(cache_pb2.ReserveRequest(running_seqs=[grown]))
        decode = cache_pb2.SequenceRequest(seq_id="a", num_tokens=101, num_computed=100)
        (tail,) = stub.Reserve(cache_pb2.ReserveRequest(running_seqs=[decode])).tables
        # token 100 reads keys 81..100: blocks 5 and 6 of 16 tokens; blocks 0..4 are released
        assert tail.first_block == 6 and len(tail.block_ids) == 1
        stats = windowed.stats()
        assert (stats.used_blocks, stats.table_slots, stats.stored_tokens) == (3, 2 * BLOCK_SIZE, 101)
        details = refused(stub.CreatePool, pool_request(), grpc.StatusCode.FAILED_PRECONDITION)
        assert "tables keep a 20-token window" in details
        stub.Free(cache_pb2.FreeRequest(seq_ids=["a"]))
        assert windowed.stats().used_blocks == 1
        details = refused(
            stub.CreatePool, pool_request(sliding_windows=[20]), grpc.StatusCode.INVALID_ARGUMENT
        )
        assert "sliding_windows has 1 entries for 2 layers" in details
    finally:
        assert windowed.stop() == 0


def test_kv_groups_keep_a_table_each_and_the_sliding_one_releases_before_its_window(tmp_path):
    grouped = Service(tmp_path, "--kv-blocks", "32", "--no-prefix-cache")
    try:
        stub = grouped.stub
        handle = stub.CreatePool(pool_request(sliding_windows=[0, 20]))
        # one full and one sliding layer: two groups of one layer, a pool of one layer slot
        assert [(list(g.layers), g.window) for g in handle.kv_groups] == [([0], 0), ([1], 20)]
        assert list(handle.shape) == [1, 2, 32, BLOCK_SIZE, HEADS, HEAD_DIM]
        (new,) = stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("a", 40)))).tables
        assert len(new.block_ids) == 3 and [len(g.block_ids) for g in new.groups] == [3]
        assert not set(new.block_ids) & set(new.groups[0].block_ids), "one free list, distinct blocks"
        grown = cache_pb2.SequenceRequest(seq_id="a", num_tokens=100, num_computed=40)
        stub.Reserve(cache_pb2.ReserveRequest(running_seqs=[grown]))
        decode = cache_pb2.SequenceRequest(seq_id="a", num_tokens=101, num_computed=100)
        (tail,) = stub.Reserve(cache_pb2.ReserveRequest(running_seqs=[decode])).tables
        # token 100 reads keys 81..100 in the sliding layer: its blocks 0..4 are released, the full keeps 7
        assert (tail.first_block, len(tail.block_ids)) == (6, 1)
        assert [(g.first_block, len(g.block_ids)) for g in tail.groups] == [(6, 1)]
        stats = grouped.stats()
        assert [(g.num_layers, g.window, g.held_blocks) for g in stats.kv_groups] == [(1, 0, 7), (1, 20, 2)]
        assert stats.used_blocks == 7 + 2 + 1, "both groups' blocks and the null block"
        (child,) = stub.Fork(cache_pb2.ForkRequest(parent_id="a", child_ids=["b"])).tables
        assert len(child.block_ids) == 7 and len(child.groups[0].block_ids) == 7, "every group's table"
        assert grouped.stats().used_blocks == 10, "a fork shares the blocks of every group"
        stub.Free(cache_pb2.FreeRequest(seq_ids=["a", "b"]))
        assert grouped.stats().used_blocks == 1
        details = refused(stub.CreatePool, pool_request(), grpc.StatusCode.FAILED_PRECONDITION)
        assert "2 KV groups" in details and "a 20-token window" in details
    finally:
        assert grouped.stop() == 0


def test_a_prefix_hit_holds_in_every_kv_group_and_a_sliding_one_keeps_only_its_window(tmp_path):
    grouped = Service(tmp_path, "--kv-blocks", "32")
    try:
        stub = grouped.stub
        handle = stub.CreatePool(pool_request(sliding_windows=[0, 20]))
        assert [(list(g.layers), g.window) for g in handle.kv_groups] == [([0], 0), ([1], 20)]
        prompt = list(range(100))
        first = cache_pb2.SequenceRequest(seq_id="a", num_tokens=100, token_ids=prompt)
        stub.Reserve(cache_pb2.ReserveRequest(new_seqs=[first]))
        stub.Free(cache_pb2.FreeRequest(seq_ids=["a"], num_computed={"a": 100}))
        longer = cache_pb2.SequenceRequest(seq_id="b", num_tokens=101, token_ids=[*prompt, 7])
        looked_up = stub.Lookup(cache_pb2.LookupRequest(seqs=[longer]))
        # six whole blocks of 16 before the last token's; token 96 reads keys 77..96: blocks 4 and 5
        assert list(looked_up.cached_tokens) == [96]
        (table,) = stub.Reserve(cache_pb2.ReserveRequest(new_seqs=[longer])).tables
        assert table.cached_tokens == 96 and len(table.block_ids) == 7
        (sliding,) = table.groups
        null = sliding.block_ids[0]
        assert list(sliding.block_ids[:4]) == [null] * 4 and null not in sliding.block_ids[4:]
        assert list(table.block_ids[:6]) == list(looked_up.prefix_blocks[0].block_ids)
        stats = grouped.stats()
        assert [g.held_blocks for g in stats.kv_groups] == [7, 3]
        assert (stats.prefix_hit_tokens, stats.num_sequences) == (96, 1)
        stub.Free(cache_pb2.FreeRequest(seq_ids=["b"]))
        assert grouped.stats().used_blocks == 1, "the null block"
    finally:
        assert grouped.stop() == 0
