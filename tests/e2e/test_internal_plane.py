"""The internal plane accepts only the stack (issue 13), against real processes with the tiny model.

Before: cache and compute listened on plaintext TCP (127.0.0.1, or 0.0.0.0 in compose) and served anyone
who connected: any local user could ReadBlock a victim's K/V, Forward into a victim's cached block,
AttachPool a file of theirs or Reserve the whole pool. Now `pagedserve up` puts them on unix sockets in a
0700 directory, and across hosts they require a client certificate of the plane's CA and check per RPC what
its identity may call.
"""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from cli import certs
from cli.launch import GATEWAY_SERVICE, Stack
from cli.processes import services_of
from common import transport
from common.server import channel
from protos import cache_pb2, cache_pb2_grpc, common_pb2, compute_pb2, compute_pb2_grpc
from sdk.client import Client
from tests.forward import forward_request
from tests.helpers import PAGEDSERVE, ROOT, free_port, start, stop, wait_healthy

pytestmark = pytest.mark.e2e
NOBODY = 65534
GREEDY = dict(token_ids=[3, 40, 50, 60], max_tokens=8, temperature=0.0, ignore_eos=True)
# What another local user runs: a plain connect() to each path (the system python: ours is under /root).
CONNECT = """
import socket, sys
for path in sys.argv[1:]:
    unix = path.startswith("/")
    address = path if unix else ("127.0.0.1", int(path))
    with socket.socket(socket.AF_UNIX if unix else socket.AF_INET) as sock:
        try:
            sock.connect(address)
            print("connected")
        except OSError as err:
            print(err.strerror)
"""


@pytest.fixture(scope="module")
def local_stack(tiny_model, logs):
    stack = Stack.start("--model", str(tiny_model), "--dtype", "float32", "--kv-blocks", "64",
                        log_dir=logs, cwd=ROOT, timeout=300)  # fmt: skip
    yield stack
    assert stack.stop() == 0


def listening_tcp_ports(pid: int) -> set[int]:
    """The TCP ports process pid listens on (its sockets' inodes in the kernel's LISTEN table)."""
    fds = Path(f"/proc/{pid}/fd")
    links = (str(fd.readlink()) for fd in fds.iterdir() if fd.is_symlink())
    inodes = {link[len("socket:[") : -1] for link in links if link.startswith("socket:[")}
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_up_opens_no_tcp_port_for_cache_and_compute(local_stack):
    pids = services_of(local_stack.proc.pid)
    gateway_port = int(local_stack.target.rsplit(":", 1)[1])
    assert gateway_port in listening_tcp_ports(pids["gateway"]), "the check sees a listening port"
    for name in ("cache", "compute"):
        metrics = local_stack.metrics_base + (1 if name == "cache" else 2)
        assert listening_tcp_ports(pids[name]) == {metrics}, f"{name}: only its /metrics, asked for"
        socket = Path(getattr(local_stack, f"{name}_target").removeprefix("unix:"))
        assert socket.is_socket() and socket.stat().st_mode & 0o777 == 0o600
    assert local_stack.runtime_dir.stat().st_mode & 0o777 == 0o700
    with local_stack.client() as client:
        assert len(client.generate(**GREEDY).token_ids) == 8


def test_another_user_cannot_reach_cache_or_compute(local_stack):
    """uid 65534 (nobody) can connect to the gateway's public port, so it could to a TCP cache or compute;
    it cannot connect to their sockets: no ReadBlock, no Forward into a victim's block, no Reserve."""
    with local_stack.client() as client:
        before = client.generate(**GREEDY).token_ids
    sockets = [
        target.removeprefix("unix:") for target in (local_stack.cache_target, local_stack.compute_target)
    ]
    attack = subprocess.run(
        ["/usr/bin/python3", "-c", CONNECT, local_stack.target.rsplit(":", 1)[1], *sockets],
        user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True, timeout=30, cwd="/",
    )  # fmt: skip
    assert attack.returncode == 0, attack.stderr
    assert attack.stdout.splitlines() == ["connected", "Permission denied", "Permission denied"]
    # The same uid may (the trust boundary): and the stack is as it was.
    assert local_stack.stats().used_blocks == 0
    with local_stack.client() as client:
        assert client.generate(**GREEDY).token_ids == before


@pytest.fixture(scope="module")
def mtls(tiny_model, tmp_path_factory):
    """Cache, compute and gateway on TCP with --internal-certs (and a second CA, for a stranger)."""
    tmp = tmp_path_factory.mktemp("mtls")
    certs.generate(tmp / "certs")
    certs.generate(tmp / "other")
    ports = {name: free_port() for name in ("cache", "compute", "gateway")}
    targets = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    argv = {
        "cache_service": ["--kv-blocks", "64"],
        "compute_service": ["--model", str(tiny_model), "--dtype", "float32", "--threads", "1"],
        "gateway": ["--model", str(tiny_model), "--cache-target", targets["cache"],
                    "--compute-target", targets["compute"]],
    }  # fmt: skip
    procs = []
    try:
        for (module, args), name in zip(argv.items(), ports, strict=True):
            flags = ["--port", str(ports[name]), "--internal-certs", str(tmp / "certs")]
            procs.append(start(module, *args, *flags, log_path=tmp / f"{name}.log"))
            own = None if name == "gateway" else transport.client_credentials(tmp / "certs", name)
            wait_healthy(targets[name], procs[-1], 120, GATEWAY_SERVICE if name == "gateway" else "", own)
        yield SimpleNamespace(certs=tmp / "certs", other=tmp / "other", targets=targets)
    finally:
        for proc in reversed(procs):
            assert stop(proc) == 0


def as_identity(mtls, identity: str, certs_dir: Path | None = None):
    credentials = transport.client_credentials(certs_dir or mtls.certs, identity)
    cache = cache_pb2_grpc.CacheStub(channel(mtls.targets["cache"], credentials))
    compute = compute_pb2_grpc.ComputeStub(channel(mtls.targets["compute"], credentials))
    return cache, compute


def code_of(call, request) -> grpc.StatusCode:
    try:
        call(request, timeout=10)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_a_caller_without_a_valid_client_certificate_is_refused(mtls):
    ca_only = grpc.ssl_channel_credentials((mtls.certs / "ca.pem").read_bytes())
    stranger = transport.client_credentials(mtls.other, "gateway")
    for credentials in (None, ca_only, stranger):
        cache = cache_pb2_grpc.CacheStub(channel(mtls.targets["cache"], credentials))
        compute = compute_pb2_grpc.ComputeStub(channel(mtls.targets["compute"], credentials))
        assert code_of(cache.GetStats, cache_pb2.GetStatsRequest()) == grpc.StatusCode.UNAVAILABLE
        assert (
            code_of(cache.ReadBlock, cache_pb2.ReadBlockRequest(include_data=True))
            == grpc.StatusCode.UNAVAILABLE
        )
        assert code_of(compute.GetModelInfo, compute_pb2.GetModelInfoRequest()) == grpc.StatusCode.UNAVAILABLE


def test_the_operator_may_read_but_not_change_anything(mtls):
    cache, compute = as_identity(mtls, "operator")
    stats = cache.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    assert stats.total_blocks == 64 and stats.pool_epoch
    assert compute.GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10).num_layers == 2
    whole_pool = cache_pb2.ReserveRequest(
        new_seqs=[cache_pb2.SequenceRequest(seq_id="jam", num_tokens=64 * 16)]
    )
    poison = forward_request([[9] * 16], [0], [[0]], block_size=16, epoch=stats.pool_epoch)
    handle = common_pb2.PoolHandle(device="cpu", epoch=stats.pool_epoch)
    denied = {
        "Reserve": code_of(cache.Reserve, whole_pool),
        "Free": code_of(cache.Free, cache_pb2.FreeRequest(seq_ids=["jam"])),
        "CreatePool": code_of(cache.CreatePool, cache_pb2.CreatePoolRequest(memory_bytes=10**15)),
        "Forward": code_of(compute.Forward, poison),
        "AttachPool": code_of(compute.AttachPool, handle),
    }
    assert denied == dict.fromkeys(denied, grpc.StatusCode.PERMISSION_DENIED)
    with pytest.raises(grpc.RpcError) as info:
        compute.Forward(poison, timeout=10)
    assert info.value.details().startswith("identity 'operator' may not call /pagedserve.v1.Compute/Forward")
    after = cache.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    assert (after.used_blocks, after.pool_epoch) == (stats.used_blocks, stats.pool_epoch), "nothing changed"


def test_the_gateway_identity_serves_generation_end_to_end(mtls):
    with Client(mtls.targets["gateway"], timeout=60) as client:
        first = client.generate(**GREEDY).token_ids
        assert len(first) == 8 and client.generate(**GREEDY).token_ids == first
    cache, _ = as_identity(mtls, "gateway")
    assert cache.GetStats(cache_pb2.GetStatsRequest(), timeout=10).used_blocks == 0
    cache_as_cache, _ = as_identity(mtls, "cache")
    assert code_of(cache_as_cache.GetStats, cache_pb2.GetStatsRequest()) == grpc.StatusCode.PERMISSION_DENIED


def test_operator_tools_connect_with_the_operator_certificate(mtls):
    stats = subprocess.run(
        [*PAGEDSERVE, "stats", "--json", "--cache-target", mtls.targets["cache"],
         "--internal-certs", str(mtls.certs)], cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert stats.returncode == 0 and '"total_blocks": 64' in stats.stdout, stats.stderr
    plain = subprocess.run([*PAGEDSERVE, "stats", "--cache-target", mtls.targets["cache"]],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
    health = [
        sys.executable,
        "-m",
        "common.healthcheck",
        mtls.targets["compute"],
        "--internal-certs",
        str(mtls.certs),
    ]
    assert (
        subprocess.run(
            [*health, "--identity", "compute"], cwd=ROOT, capture_output=True, timeout=60
        ).returncode
        == 0
    )
