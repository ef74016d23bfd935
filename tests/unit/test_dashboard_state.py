"""The dashboard's data: the block map as the page reads it, the engine's published view, the charts'
history, and /dashboard/state over a real HTTP server (API keys, what another key's viewer sees)."""

import base64
import json
import ssl
import urllib.error
import urllib.request
from dataclasses import replace

import grpc
import pytest

from cache_service import block_map
from cache_service.allocators import registry
from cache_service.block_manager import BlockManager
from cache_service.hybrid_blocks import HybridBlocks
from cache_service.sequence import SeqRequest
from common.kv_groups import group_layers
from gateway.auth import ApiKeys, Tenant
from gateway.engine_view import MAX_WAITING_SHOWN, EngineSnapshot, EngineView, SeqView, Totals
from gateway.http import dashboard
from gateway.http.app import create_app
from gateway.http.dashboard_state import DashboardSource, pool_json, seqs_json
from gateway.http.history import History
from gateway.http.serve import HttpServer
from gateway.outputs import Output
from protos import cache_pb2
from tests.blocks import allocate
from tests.certs import self_signed
from tests.helpers import free_port
from tests.scheduling import make, run, seq

KEYS = {"alice": "alice-0123456789abcdef", "bob": "bob-0123456789abcdef"}


def test_the_page_reads_one_character_per_block_and_the_refcounts_in_base64():
    blocks = BlockManager(registry.create("freelist", 12), 4, model="m")
    (kept,) = allocate(blocks, [SeqRequest("kept", 9, list(range(9)))])
    blocks.fork("kept", ["child"])
    (gone,) = allocate(blocks, [SeqRequest("gone", 4, [40, 41, 42, 43])])
    blocks.free(["gone"], {"gone": 4})
    pool = pool_json(block_map.encode(blocks, "ep"))
    assert len(pool["states"]) == pool["num_blocks"] == 12
    assert "".join(pool["states"][b] for b in kept) == "uuu"
    assert pool["states"][gone[0]] == "c"
    assert pool["counts"] == {"free": 8, "used": 3, "cached": 1, "shared": 3}
    assert list(base64.b64decode(pool["refcounts"])) == [blocks.refcount(b) for b in range(12)]
    assert (pool["epoch"], pool["block_size"]) == ("ep", 4)


def test_a_grouped_pool_marks_its_null_block_and_a_sequence_shows_every_groups_blocks():
    blocks = HybridBlocks(registry.create("freelist", 32), group_layers([0, 5]), 4, prefix_caching=False)
    blocks.reserve([SeqRequest("a", 16, list(range(16)))], ())  # 4 blocks in each group
    blocks.reserve((), [SeqRequest("a", 17, [16], num_computed=16)])  # the sliding group releases 3
    pool = pool_json(block_map.encode(blocks, "ep"))
    full, sliding = blocks.block_tables("a")
    assert sliding[:3] == [blocks.null_block] * 3
    assert pool["states"][blocks.null_block] == "n"
    assert pool["counts"] == {"free": 32 - 1 - 5 - 2, "used": 7, "cached": 0, "shared": 0}
    (shown,) = seqs_json([("running", view("a", "alice", full, sliding))], None)
    assert shown["tables"] == [full, sliding]
    assert shown["blocks"] == full + [blocks.null_block] + sliding[3:], "each block once, every group's"


def test_a_state_this_gateway_does_not_know_reads_as_a_question_mark():
    reply = cache_pb2.BlockMap(num_blocks=3, states=bytes([0, 7, 2]), refcounts=bytes([0, 1, 0]))
    assert pool_json(reply)["states"] == "f?c"


def view(seq_id: str, tenant: str, *tables) -> SeqView:
    return SeqView(seq_id, f"req-{seq_id}", tenant, 0, 10, 3, 12, 4, 0, tuple(map(tuple, tables or [(1, 2)])))


def test_a_viewer_sees_its_own_sequences_in_full_and_the_others_without_ids():
    views = [("running", view("a1", "alice")), ("running", view("b1", "bob")), ("waiting", view("b2", "bob"))]
    shown = seqs_json(views, Tenant("alice", "ns"))
    assert [(s["id"], s["request_id"], s["own"]) for s in shown] == [
        ("a1", "req-a1", True), ("other-1", "", False), ("other-2", "", False)
    ]  # fmt: skip
    assert all(s["blocks"] == [1, 2] and s["prompt_tokens"] == 10 for s in shown)
    assert [s["status"] for s in shown] == ["running", "running", "waiting"]
    assert [s["id"] for s in seqs_json(views, None)] == ["a1", "b1", "b2"], "no keys: everyone sees all"


def test_the_engine_publishes_its_queues_and_tables_as_they_are_between_steps():
    scheduler = make(block_size=4, num_blocks=400, max_batched_tokens=1000, max_seqs=2)
    engine_view = EngineView()
    for name in ("a", "b", *(f"w{i}" for i in range(MAX_WAITING_SHOWN + 5))):
        scheduler.add(replace(seq(name, 9), request_id=f"r-{name}", tenant="alice"))
    run(scheduler, scheduler.schedule())
    engine_view.publish(scheduler, scheduler.kv)
    unwatched = engine_view.snapshot
    assert not unwatched.listed and unwatched.running == unwatched.waiting == ()
    assert (unwatched.num_running, unwatched.num_waiting) == (2, MAX_WAITING_SHOWN + 5), "counts always"
    engine_view.watch()
    engine_view.publish(scheduler, scheduler.kv)
    snapshot = engine_view.snapshot
    assert snapshot.listed
    assert [v.seq_id for v in snapshot.running] == ["a", "b"]
    assert snapshot.running[0].tables == (tuple(scheduler.kv.block_table(scheduler.running[0])),)
    assert len(snapshot.running[0].tables[0]) == 3 and snapshot.running[0].generated_tokens == 1
    assert (snapshot.running[0].request_id, snapshot.running[0].tenant) == ("r-a", "alice")
    assert len(snapshot.waiting) == MAX_WAITING_SHOWN and snapshot.num_waiting == MAX_WAITING_SHOWN + 5
    assert snapshot.waiting[0].tables == ()
    assert snapshot.kv_usage == pytest.approx(6 / 400)
    scheduler.running[0].output_ids.append(5)
    assert engine_view.snapshot.running[0].generated_tokens == 1, "a snapshot does not change"


def test_an_idle_engine_lists_its_empty_queues_unwatched():
    scheduler = make(block_size=4, num_blocks=40, max_batched_tokens=100, max_seqs=2)
    engine_view = EngineView()
    engine_view.publish(scheduler, scheduler.kv)
    assert engine_view.snapshot.listed and engine_view.snapshot.num_running == 0


def test_totals_count_generated_tokens_and_prompts_at_their_first_token():
    engine_view = EngineView()
    first = replace(seq("a", 32), output_ids=[5], cached_tokens=16)
    later = replace(seq("b", 8), output_ids=[5, 6])
    sample = replace(seq("c", 32), output_ids=[5], index=1, cached_tokens=16)
    engine_view.account([(s, Output([s.output_ids[-1]], None)) for s in (first, later, sample)])
    assert engine_view.totals == Totals(generated_tokens=3, prompt_tokens=32, cached_tokens=16)


def test_history_samples_rates_over_each_interval():
    state = {"snapshot": EngineSnapshot(num_blocks=100, available_blocks=100), "totals": Totals()}
    history = History(lambda: (state["snapshot"], state["totals"]), interval_s=1.0, size=3)
    history.sample(now=0.0)
    assert history.series()["t"] == [], "the first call only starts an interval"
    state["snapshot"] = EngineSnapshot(num_blocks=100, available_blocks=75, preemptions=2)
    state["totals"] = Totals(generated_tokens=40, prompt_tokens=100, cached_tokens=25)
    history.sample(now=2.0)
    history.sample(now=3.0)
    series = history.series()
    assert series["tokens_per_s"] == [20.0, 0.0]
    assert series["kv_usage"] == [0.25, 0.25]
    assert series["hit_rate"] == [0.25, None], "no prompt in the second interval: no rate"
    assert series["preemptions"] == [2, 0]
    for now in (4.0, 5.0, 6.0):
        history.sample(now=now)
    assert len(history.series()["t"]) == 3, "a ring of `size` samples"


class FakeEngine:
    def __init__(self, views: list[SeqView]) -> None:
        self.view = EngineView()
        self.view.snapshot = EngineSnapshot(
            listed=True, running=tuple(views), num_running=len(views), num_blocks=8, available_blocks=6
        )
        self.model_info = None

    def attached_epoch(self) -> str | None:
        return "ep"


class Unreachable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


class FakeCache:
    def __init__(self) -> None:
        self.calls, self.down = 0, False

    def GetBlockMap(self, request, timeout=None) -> cache_pb2.BlockMap:
        self.calls += 1
        if self.down:
            raise Unreachable()
        return cache_pb2.BlockMap(num_blocks=8, block_size=4, states=bytes([1, 1, 0, 0, 2, 0, 0, 0]),
                                  refcounts=bytes([1, 2, 0, 0, 0, 0, 0, 0]), pool_epoch="ep")  # fmt: skip


def serve_dashboard(source: DashboardSource, cert=None, key=None) -> HttpServer:
    """The dashboard's routes served on a free port (HTTPS with cert and key)."""
    server = HttpServer("127.0.0.1", free_port(), cert, key)
    server.start(create_app([dashboard.installer(source)]))
    return server


@pytest.fixture(params=["keys", "no keys"])
def front(request):
    keys = ApiKeys(list(KEYS.items())) if request.param == "keys" else None
    cache = FakeCache()
    source = DashboardSource(FakeEngine([view("a1", "alice", (0,)), view("b1", "bob", (1,))]), cache, keys)
    server = serve_dashboard(source)
    server.cache, server.keys = cache, keys
    yield server
    server.stop()


def get(front, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{front.port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_the_page_and_its_files_are_served_from_the_package_to_anyone(front):
    status, headers, body = get(front, "/dashboard")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b'<script src="/dashboard/static/dashboard.js">' in body
    assert "default-src 'self'" in headers["content-security-policy"]
    status, headers, body = get(front, "/dashboard/static/dashboard.js")
    assert status == 200 and headers["content-type"].startswith("text/javascript")
    assert b"/dashboard/state" in body
    assert get(front, "/dashboard/static/dashboard.css")[0] == 200
    assert get(front, "/dashboard/static/..%2Fdashboard.py")[0] == 404
    assert get(front, "/dashboard/static/nothing.js")[0] == 404


def test_with_keys_the_state_needs_one_as_a_header_or_a_query_parameter(front):
    if front.keys is None:
        status, _, body = get(front, "/dashboard/state")
        state = json.loads(body)
        assert status == 200 and state["viewer"] is None
        assert [s["id"] for s in state["sequences"]] == ["a1", "b1"]
        return
    for headers, path in [({}, ""), ({"Authorization": "Bearer wrong-0123456789abcdef"}, ""), ({}, "?key=x")]:
        status, reply_headers, body = get(front, "/dashboard/state" + path, headers)
        assert status == 401, (headers, path)
        assert reply_headers["www-authenticate"] == "Bearer"
        assert json.loads(body)["error"]["type"] == "authentication_error"
        assert b"a1" not in body and b"req-" not in body
    assert front.cache.calls == 0, "a refused caller costs the cache service nothing"
    status, _, body = get(front, f"/dashboard/state?key={KEYS['bob']}")
    state = json.loads(body)
    assert status == 200 and state["viewer"] == "bob"
    assert [(s["id"], s["request_id"]) for s in state["sequences"]] == [("other-1", ""), ("b1", "req-b1")]
    _, _, body = get(front, "/dashboard/state", {"Authorization": f"Bearer {KEYS['alice']}"})
    assert [s["id"] for s in json.loads(body)["sequences"]] == ["a1", "other-1"]


def test_the_state_carries_the_pool_and_polls_share_one_block_map_fetch(front):
    auth = {"Authorization": f"Bearer {KEYS['alice']}"} if front.keys else {}
    states = [json.loads(get(front, "/dashboard/state", auth)[2]) for _ in range(5)]
    assert front.cache.calls == 1, "five polls within MAP_MAX_AGE_S: one GetBlockMap"
    state = states[-1]
    assert state["pool"]["states"] == "uuffcfff"
    assert state["pool"]["counts"] == {"free": 5, "used": 2, "cached": 1, "shared": 1}
    assert state["kv_usage"] == 0.25 and state["attached_epoch"] == "ep" and state["pool_error"] is None
    assert set(state["history"]) == {"interval_s", "t", "tokens_per_s", "kv_usage", "hit_rate", "preemptions"}


def test_a_cache_that_cannot_be_reached_is_reported_not_raised():
    cache = FakeCache()
    cache.down = True
    source = DashboardSource(FakeEngine([]), cache, None)
    state = source.state(None)
    assert state["pool"] is None
    assert "UNAVAILABLE: connection refused" in state["pool_error"]


def test_with_the_gateway_certificate_the_front_speaks_only_https(tmp_path):
    cert, key = self_signed(tmp_path)
    source = DashboardSource(FakeEngine([]), FakeCache(), None)
    server = serve_dashboard(source, cert, key)
    try:
        trusted = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://127.0.0.1:{server.port}/dashboard", context=trusted) as reply:
            assert reply.status == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/dashboard", timeout=5)
    finally:
        server.stop()
