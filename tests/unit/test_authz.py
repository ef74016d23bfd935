"""common.authz: each service's table covers its RPCs, and under mTLS a caller may make only the calls its
certificate's identity is allowed (an in-process server with the Cache service's table)."""

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.callers import CALLERS as CACHE_CALLERS
from cli import certs
from common import authz, transport
from common.server import channel, serve
from compute_service.callers import CALLERS as COMPUTE_CALLERS
from protos import cache_pb2, cache_pb2_grpc

CACHE = "/pagedserve.v1.Cache/"
HEALTH = "/grpc.health.v1.Health/Check"


def test_only_the_gateway_changes_state_and_operators_may_read():
    for method in ("CreatePool", "Reserve", "Fork", "Free", "OpenSession", "RenewSession", "CloseSession"):
        assert authz.allowed(CACHE_CALLERS, CACHE + method, "gateway")
        assert not authz.allowed(CACHE_CALLERS, CACHE + method, "operator")
    for method in ("AttachPool", "Forward"):
        assert authz.allowed(COMPUTE_CALLERS, f"/pagedserve.v1.Compute/{method}", "gateway")
        assert not authz.allowed(COMPUTE_CALLERS, f"/pagedserve.v1.Compute/{method}", "operator")
    for identity in ("gateway", "operator"):
        assert authz.allowed(CACHE_CALLERS, CACHE + "GetStats", identity)
        assert authz.allowed(CACHE_CALLERS, CACHE + "ReadBlock", identity)
        assert authz.allowed(COMPUTE_CALLERS, "/pagedserve.v1.Compute/GetModelInfo", identity)
    for method in ("LoadLoraAdapter", "UnloadLoraAdapter"):
        for identity in ("gateway", "operator"):
            assert authz.allowed(COMPUTE_CALLERS, f"/pagedserve.v1.Compute/{method}", identity)
        assert not authz.allowed(COMPUTE_CALLERS, f"/pagedserve.v1.Compute/{method}", "cache")
    for identity in ("cache", "compute", "stranger"):
        assert not authz.allowed(CACHE_CALLERS, CACHE + "GetStats", identity)
        assert authz.allowed(CACHE_CALLERS, HEALTH, identity), "health answers any valid identity"
    assert not authz.allowed(CACHE_CALLERS, HEALTH, None), "no certificate, no identity"
    assert not authz.allowed(CACHE_CALLERS, CACHE + "Undeclared", "gateway"), "undeclared methods are closed"


def test_a_table_must_declare_every_rpc_of_its_service():
    with pytest.raises(AssertionError, match="Fork"):
        authz.table("pagedserve.v1.Cache", {"Reserve": authz.GATEWAY}, ["Reserve", "Fork"])


def test_the_identity_is_the_common_name_without_the_prefix():
    assert authz.identity_of({"x509_common_name": [b"pagedserve-gateway"]}) == "gateway"
    assert authz.identity_of({"x509_common_name": [b"someone"]}) == "someone"
    assert authz.identity_of({"transport_security_type": [b"insecure"]}) is None


class Refusing(cache_pb2_grpc.CacheServicer):
    """Answers GetStats and Free; a call that reaches it passed authorization."""

    def GetStats(self, request, context):
        return cache_pb2.CacheStats(total_blocks=7)

    def Free(self, request, context):
        return cache_pb2.FreeResponse()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("authz")
    certs.generate(tmp / "certs")
    certs.generate(tmp / "other")
    log = structlog.get_logger()
    services = [(cache_pb2_grpc.add_CacheServicer_to_server, Refusing(), "pagedserve.v1.Cache")]
    started = serve(
        services,
        "127.0.0.1",
        0,
        log,
        credentials=transport.server_credentials(tmp / "certs", "cache"),
        interceptors=[authz.Authorizer(CACHE_CALLERS, log)],
    )
    yield tmp, f"127.0.0.1:{started.port}"
    started.stop(0)


def call(target: str, method: str, credentials=None):
    with channel(target, credentials) as ch:
        stub = cache_pb2_grpc.CacheStub(ch)
        request = cache_pb2.GetStatsRequest() if method == "GetStats" else cache_pb2.FreeRequest()
        try:
            return getattr(stub, method)(request, timeout=5)
        except grpc.RpcError as err:
            return err


def test_callers_are_checked_by_identity(server):
    tmp, target = server
    gateway = transport.client_credentials(tmp / "certs", "gateway")
    operator = transport.client_credentials(tmp / "certs", "operator")
    assert call(target, "GetStats", gateway).total_blocks == 7
    assert call(target, "Free", gateway) == cache_pb2.FreeResponse()
    assert call(target, "GetStats", operator).total_blocks == 7
    denied = call(target, "Free", operator)
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'operator' may not call /pagedserve.v1.Cache/Free" in denied.details()
    assert call(target, "GetStats", transport.client_credentials(tmp / "certs", "compute")).code() == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    with channel(target, transport.client_credentials(tmp / "certs", "cache")) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_caller_without_a_certificate_of_this_ca_is_refused(server):
    tmp, target = server
    assert call(target, "GetStats").code() == grpc.StatusCode.UNAVAILABLE, "plaintext"
    stranger = transport.client_credentials(tmp / "other", "gateway")
    assert call(target, "GetStats", stranger).code() == grpc.StatusCode.UNAVAILABLE, "another CA's gateway"
    no_client_cert = grpc.ssl_channel_credentials((tmp / "certs" / "ca.pem").read_bytes())
    assert call(target, "GetStats", no_client_cert).code() == grpc.StatusCode.UNAVAILABLE, (
        "TLS, no client cert"
    )
