"""The fuzz suite: hostile but valid protobuf messages (tests/fuzz_strategies.py) sent to every RPC of the
three services, run once per module as real processes (cache, compute with a tiny random-weight model,
gateway) on 127.0.0.1. Each call must

- return OK or a status of its service's documented set (DOCUMENTED; never INTERNAL or UNKNOWN), from the
  service itself (not gRPC refusing its answer, e.g. trailers past the metadata limit),
- leave every service alive and SERVING,
- when it refuses a call that would change the pool (a mutating Cache RPC), leave the block counts as they
  were (used, free, cached blocks and sequences, from GetStats),
- never touch memory outside the pool: compute still runs, a reference greedy generation is the same
  before and after the whole run (on a fresh cache_salt, so no block the fuzzer wrote is read), and the
  pool's segment keeps its size.

While Generate is fuzzed, a neighbour stream runs the reference request again and again: each must end with
the reference tokens (one bad request never fails its neighbours). Examples per RPC: PAGEDSERVE_FUZZ_EXAMPLES
(default EXAMPLES); derandomized, so a CI run is reproducible. The RPC x status counts are printed at the
end of the module (and written to fuzz_counts.json in its log directory).
"""

import json
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.healthcheck import serving
from common.server import channel
from protos import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    compute_pb2,
    compute_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)
from sdk.client import Client
from tests.fuzz_strategies import (
    Live,
    copies,
    hints,
    messages,
    near_valid,
    valid_embed,
    valid_fork,
    valid_forward,
    valid_free,
    valid_generate,
    valid_reserve,
    valid_steps,
)
from tests.helpers import free_port, start, stop, wait_healthy
from tests.processes import segments_of

pytestmark = pytest.mark.e2e
EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    # NOTE: a function-scoped fixture (the neighbour stream) runs once per test, beside all its examples.
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)
S = grpc.StatusCode
# What each service may answer a hostile call with, besides OK. PERMISSION_DENIED and UNAUTHENTICATED are a
# caller the plane or the edge does not let in.
DOCUMENTED = {
    "Cache": {S.INVALID_ARGUMENT, S.FAILED_PRECONDITION, S.RESOURCE_EXHAUSTED, S.NOT_FOUND, S.ALREADY_EXISTS,
              S.OUT_OF_RANGE, S.PERMISSION_DENIED, S.UNAUTHENTICATED},
    "Compute": {S.INVALID_ARGUMENT, S.FAILED_PRECONDITION, S.RESOURCE_EXHAUSTED, S.NOT_FOUND,
                S.PERMISSION_DENIED, S.UNAUTHENTICATED},
    "Generation": {S.INVALID_ARGUMENT, S.RESOURCE_EXHAUSTED, S.FAILED_PRECONDITION, S.PERMISSION_DENIED,
                   S.UNAUTHENTICATED},
}  # fmt: skip
SERVICE_OF = {"cache": "Cache", "compute": "Compute", "gateway": "Generation"}
GATEWAY_SERVICE = "pagedserve.v1.Generation"
SESSION = "fuzz-session"
LIVE_SEQS = {"fuzz-a": 20, "fuzz-b": 40}
REFERENCE = dict(token_ids=[5, 17, 99, 42, 7, 200, 31], max_tokens=24, temperature=0.0, ignore_eos=True)
# Generate: the responses read before the stream is cancelled (its status is known by then).
READ_RESPONSES = 3
COUNTS: dict[str, Counter] = defaultdict(Counter)
# The first message of each (RPC, status), for the report.
EXAMPLE_DETAILS: dict[str, str] = {}


@dataclass
class Services:
    targets: dict[str, str]
    procs: dict[str, subprocess.Popen]

    def alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"the {name} service exited with {proc.returncode}"


def start_services(model: Path, logs: Path, sockets: Path) -> Services:
    """The one place this module starts processes: cache and compute on unix sockets in `sockets` (as
    `pagedserve up` runs them), the gateway on a free 127.0.0.1 port."""
    targets = {"cache": f"unix:{sockets / 'cache.sock'}", "compute": f"unix:{sockets / 'compute.sock'}"}
    targets["gateway"] = f"127.0.0.1:{free_port()}"
    argv = {
        "cache": ["cache_service", "--kv-blocks", "96", "--socket", str(sockets / "cache.sock")],
        "compute": ["compute_service", "--model", str(model), "--dtype", "float32", "--threads", "1",
                    "--pooling", "last", "--socket", str(sockets / "compute.sock")],
        "gateway": ["gateway", "--model", str(model), "--log-format", "json",
                    "--cache-target", targets["cache"], "--compute-target", targets["compute"],
                    "--port", targets["gateway"].rsplit(":", 1)[1]],
    }  # fmt: skip
    services = Services(targets, {})
    for name, (module, *args) in argv.items():
        proc = start(module, *args, log_path=logs / f"{name}.log")
        services.procs[name] = proc
        wait_healthy(targets[name], proc, 120, GATEWAY_SERVICE if name == "gateway" else "")
    return services


@dataclass
class Fuzzed:
    """The services under fuzz, their stubs and what is live in them."""

    services: Services
    cache: cache_pb2_grpc.CacheStub
    compute: compute_pb2_grpc.ComputeStub
    gateway: generation_pb2_grpc.GenerationStub
    live: Live
    create_pool: cache_pb2.CreatePoolRequest
    reference: list[int]

    def counts(self) -> tuple[int, ...]:
        s = self.cache.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
        return s.used_blocks, s.free_blocks, s.cached_blocks, s.num_sequences

    def reset_session(self) -> None:
        """The fuzzer's session open afresh, holding exactly LIVE_SEQS (so hostile calls meet live ids)."""
        close_session(self.cache, SESSION)  # open, or not yet, or a fuzzed call closed it
        self.cache.OpenSession(cache_pb2.OpenSessionRequest(session_id=SESSION, ttl_s=60), timeout=10)
        new = [cache_pb2.SequenceRequest(seq_id=seq_id, num_tokens=n, token_ids=[7 + i for i in range(n)])
               for seq_id, n in LIVE_SEQS.items()]  # fmt: skip
        self.cache.Reserve(cache_pb2.ReserveRequest(new_seqs=new, session_id=SESSION), timeout=10)


def close_session(cache: cache_pb2_grpc.CacheStub, session_id: str) -> None:
    """Closes the session if it is open (NOT_FOUND: it is not)."""
    try:
        cache.CloseSession(cache_pb2.CloseSessionRequest(session_id=session_id), timeout=10)
    except grpc.RpcError as err:
        assert err.code() == S.NOT_FOUND, err


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, tiny_model, request):
    logs = tmp_path_factory.mktemp("fuzz-logs")
    # NOTE: not under tmp_path: a unix socket's path must stay within the kernel's 107 bytes.
    sockets = Path(tempfile.mkdtemp(prefix="ps-fuzz-"))
    services = Services({}, {})
    try:
        services = start_services(tiny_model, logs, sockets)
        fuzz = _attach(services)
        segment = Path(fuzz.live.handle.shm.path)
        size = segment.stat().st_size
        yield fuzz
        services.alive()
        fuzz.cache.CloseSession(cache_pb2.CloseSessionRequest(session_id=SESSION), timeout=10)
        assert fuzz.counts()[0] == 0 and fuzz.counts()[3] == 0, "the fuzzer's sequences are freed"
        assert _reference(services) == fuzz.reference, "the reference generation changed"
        assert segment.stat().st_size == size, "the pool's segment changed size"
    finally:
        _report(request, logs)
        codes = {name: stop(proc) for name, proc in reversed(services.procs.items())}
        cache = services.procs.get("cache")
        shutil.rmtree(sockets, ignore_errors=True)
        assert cache is None or not segments_of(cache.pid), "a segment was left in /dev/shm"
    assert set(codes.values()) <= {0}, f"not every service stopped on SIGTERM: {codes}"


def _attach(services: Services) -> Fuzzed:
    cache = cache_pb2_grpc.CacheStub(channel(services.targets["cache"]))
    compute = compute_pb2_grpc.ComputeStub(channel(services.targets["compute"]))
    gateway = generation_pb2_grpc.GenerationStub(channel(services.targets["gateway"]))
    info = compute.GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10)
    stats = cache.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    geometry = cache_pb2.PoolGeometry(num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                                      head_dim=info.head_dim)  # fmt: skip
    create = cache_pb2.CreatePoolRequest(geometry=geometry, block_size=stats.block_size, kv_dtype=info.dtype,
                                         model=info.model)  # fmt: skip
    handle = cache.CreatePool(create, timeout=10)
    assert handle.epoch == stats.pool_epoch, "the gateway's own CreatePool returns the live pool"
    live = Live(stats.total_blocks, stats.block_size, info.vocab_size, info.max_model_len, handle.epoch,
                LIVE_SEQS, SESSION, handle)  # fmt: skip
    fuzz = Fuzzed(services, cache, compute, gateway, live, create, _reference(services))
    fuzz.reset_session()
    return fuzz


def _reference(services: Services) -> list[int]:
    with Client(services.targets["gateway"], timeout=60) as client:
        return client.generate(**REFERENCE, cache_salt=uuid.uuid4().hex).token_ids


def _report(request, logs: Path) -> None:
    """The RPC x status table, on the terminal and in fuzz_counts.json."""
    report = {"counts": COUNTS, "first_details": EXAMPLE_DETAILS}
    (logs / "fuzz_counts.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    codes = sorted({code for counts in COUNTS.values() for code in counts})
    lines = [f"{'RPC':<24}{'examples':>9}" + "".join(f"{code:>20}" for code in codes)]
    for rpc, counts in COUNTS.items():
        lines.append(f"{rpc:<24}{sum(counts.values()):>9}" + "".join(f"{counts[c]:>20}" for c in codes))
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_sep("-", f"fuzz: examples per RPC and their statuses (logs in {logs})")
            for line in lines:
                reporter.write_line(line)


def exercise(fuzz: Fuzzed, target: str, rpc: str, call: Callable[[], object], mutating: bool = False) -> S:
    """Makes the call and checks the module docstring's rules; returns its status."""
    before = fuzz.counts() if mutating else None
    try:
        call()
        code = S.OK
    except grpc.RpcError as err:
        code, details = err.code(), err.details()
        assert code in DOCUMENTED[SERVICE_OF[target]], f"{rpc}: {code.name}: {details}"
        assert not details.startswith("Stream removed"), f"{rpc}: the transport refused the answer: {details}"
        EXAMPLE_DETAILS.setdefault(f"{SERVICE_OF[target]}.{rpc} {code.name}", details[:300])
    COUNTS[f"{SERVICE_OF[target]}.{rpc}"][code.name] += 1
    fuzz.services.alive()
    assert serving(fuzz.services.targets[target], GATEWAY_SERVICE if target == "gateway" else "", 5.0)
    if mutating and code != S.OK:
        assert fuzz.counts() == before, f"{rpc} was refused ({code.name}) but changed the block counts"
    return code


def _free_named(fuzz: Fuzzed, session_id: str, seq_ids) -> None:
    """After an accepted call: the sequences it named are freed again, one by one (unknown ones refused)."""
    for seq_id in dict.fromkeys(seq_ids):
        try:
            fuzz.cache.Free(cache_pb2.FreeRequest(seq_ids=[seq_id], session_id=session_id), timeout=10)
        except grpc.RpcError as err:
            assert err.code() in (S.NOT_FOUND, S.FAILED_PRECONDITION, S.INVALID_ARGUMENT), err


def message(data, request_type, *extra: st.SearchStrategy, live: Live):
    """A hostile message of request_type (or of one of the extra strategies)."""
    return data.draw(st.one_of(messages(request_type.DESCRIPTOR, hints(live)), *extra))


# Cache
@FUZZ
@given(data=st.data())
def test_cache_get_stats(fuzzed, data):
    request = message(data, cache_pb2.GetStatsRequest, live=fuzzed.live)
    exercise(fuzzed, "cache", "GetStats", lambda: fuzzed.cache.GetStats(request, timeout=10))


@FUZZ
@given(data=st.data())
def test_cache_read_block(fuzzed, data):
    request = message(data, cache_pb2.ReadBlockRequest, live=fuzzed.live)
    exercise(fuzzed, "cache", "ReadBlock", lambda: fuzzed.cache.ReadBlock(request, timeout=10))


@FUZZ
@given(data=st.data())
def test_cache_get_block_map(fuzzed, data):
    request = message(data, cache_pb2.GetBlockMapRequest, live=fuzzed.live)
    exercise(fuzzed, "cache", "GetBlockMap", lambda: fuzzed.cache.GetBlockMap(request, timeout=10))


@FUZZ
@given(data=st.data())
def test_cache_reserve(fuzzed, data):
    live = fuzzed.live
    request = message(data, cache_pb2.ReserveRequest, near_valid(valid_reserve(live), live), live=live)
    fuzzed.reset_session()
    if exercise(fuzzed, "cache", "Reserve", lambda: fuzzed.cache.Reserve(request, timeout=10), True) == S.OK:
        named = [seq.seq_id for seq in (*request.new_seqs, *request.running_seqs)]
        _free_named(fuzzed, request.session_id, [s for s in named if s not in LIVE_SEQS])


@FUZZ
@given(data=st.data())
def test_cache_fork(fuzzed, data):
    live = fuzzed.live
    request = message(data, cache_pb2.ForkRequest, near_valid(valid_fork(live), live), live=live)
    fuzzed.reset_session()
    if exercise(fuzzed, "cache", "Fork", lambda: fuzzed.cache.Fork(request, timeout=10), True) == S.OK:
        _free_named(fuzzed, request.session_id, [s for s in request.child_ids if s not in LIVE_SEQS])


@FUZZ
@given(data=st.data())
def test_cache_free(fuzzed, data):
    live = fuzzed.live
    request = message(data, cache_pb2.FreeRequest, near_valid(valid_free(live), live), live=live)
    fuzzed.reset_session()
    exercise(fuzzed, "cache", "Free", lambda: fuzzed.cache.Free(request, timeout=10), True)


@FUZZ
@given(data=st.data())
def test_cache_sessions(fuzzed, data):
    rpc = data.draw(st.sampled_from(["OpenSession", "RenewSession", "CloseSession"]))
    request = message(data, getattr(cache_pb2, f"{rpc}Request"), live=fuzzed.live)
    fuzzed.reset_session()
    exercise(fuzzed, "cache", rpc, lambda: getattr(fuzzed.cache, rpc)(request, timeout=10), True)
    if rpc == "OpenSession" and request.session_id not in ("", SESSION):
        close_session(fuzzed.cache, request.session_id)  # the fuzzed OpenSession may have been refused


# Compute
@FUZZ
@given(data=st.data())
def test_compute_get_model_info(fuzzed, data):
    request = message(data, compute_pb2.GetModelInfoRequest, live=fuzzed.live)
    exercise(fuzzed, "compute", "GetModelInfo", lambda: fuzzed.compute.GetModelInfo(request, timeout=10))


@FUZZ
@given(data=st.data())
def test_compute_forward(fuzzed, data):
    live = fuzzed.live
    request = message(data, compute_pb2.ForwardRequest, near_valid(valid_forward(live), live), live=live)
    exercise(fuzzed, "compute", "Forward", lambda: fuzzed.compute.Forward(request, timeout=30), True)


@FUZZ
@given(data=st.data())
def test_compute_forward_steps(fuzzed, data):
    """The caller half-closes after its first message: compute runs at most the steps already begun."""
    live = fuzzed.live
    request = message(data, compute_pb2.StepsRequest, near_valid(valid_steps(live), live), live=live)
    call = lambda: list(fuzzed.compute.ForwardSteps(iter([request]), timeout=30))  # noqa: E731
    exercise(fuzzed, "compute", "ForwardSteps", call, True)


# Generation
@pytest.fixture
def neighbour(fuzzed):
    """A stream of the reference request run again and again beside the Generate fuzz; each must end with
    the reference tokens."""
    stopped, outputs = threading.Event(), []

    def run():
        with Client(fuzzed.services.targets["gateway"], timeout=60) as client:
            while not (outputs and stopped.is_set()):
                try:
                    outputs.append(client.generate(**REFERENCE, cache_salt=uuid.uuid4().hex).token_ids)
                except Exception as exc:  # noqa: BLE001 - reported below
                    outputs.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stopped.set()
    thread.join(60)
    assert outputs and all(tokens == fuzzed.reference for tokens in outputs), outputs[:3]


@FUZZ
@given(data=st.data())
def test_generation_generate(fuzzed, neighbour, data):
    live = fuzzed.live
    request = message(data, generation_pb2.GenerateRequest, near_valid(valid_generate(live), live), live=live)

    def generate():
        stream = fuzzed.gateway.Generate(request, timeout=60)
        for read, _ in enumerate(stream, 1):
            if read == READ_RESPONSES:
                stream.cancel()
                return

    exercise(fuzzed, "gateway", "Generate", generate)


@FUZZ
@given(data=st.data())
def test_generation_get_info(fuzzed, data):
    request = message(data, generation_pb2.GetInfoRequest, live=fuzzed.live)
    exercise(fuzzed, "gateway", "GetInfo", lambda: fuzzed.gateway.GetInfo(request, timeout=10))


@FUZZ
@given(data=st.data())
def test_generation_embed(fuzzed, data):
    live = fuzzed.live
    request = message(data, generation_pb2.EmbedRequest, near_valid(valid_embed(live), live), live=live)
    exercise(fuzzed, "gateway", "Embed", lambda: fuzzed.gateway.Embed(request, timeout=60))


# the pool: last, as an accepted AttachPool or CreatePool changes what the gateway steps on
@FUZZ
@given(data=st.data())
def test_compute_attach_pool(fuzzed, data):
    live = fuzzed.live
    request = message(data, common_pb2.PoolHandle, near_valid(copies(live.handle), live), live=live)
    try:
        exercise(fuzzed, "compute", "AttachPool", lambda: fuzzed.compute.AttachPool(request, timeout=10))
    finally:
        fuzzed.compute.AttachPool(fuzzed.live.handle, timeout=10)


@FUZZ
@given(data=st.data())
def test_cache_create_pool(fuzzed, data):
    live = fuzzed.live
    request = message(
        data, cache_pb2.CreatePoolRequest, near_valid(copies(fuzzed.create_pool), live), live=live
    )
    fuzzed.reset_session()
    exercise(fuzzed, "cache", "CreatePool", lambda: fuzzed.cache.CreatePool(request, timeout=30), True)
    stats = fuzzed.cache.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    assert stats.pool_epoch == fuzzed.live.epoch, "CreatePool replaced the live pool"
