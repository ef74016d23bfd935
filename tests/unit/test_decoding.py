"""A request that does not decode gets INVALID_ARGUMENT naming the reason, on unary and streaming methods
(before: INTERNAL "Exception deserializing request!"); the server keeps serving."""

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2

from common.server import serve

CHECK, WATCH = "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"
# HealthCheckRequest.service (field 1, a string) holding the byte 0xff: not UTF-8.
BAD_UTF8 = b"\x0a\x02h\xff"


@pytest.fixture(scope="module")
def target():
    server = serve([], "127.0.0.1", 0, structlog.get_logger())
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.stop(0)


def raw_call(target: str, method: str, data: bytes, stream: bool = False):
    with grpc.insecure_channel(target) as channel:
        call = (channel.unary_stream if stream else channel.unary_unary)(method)
        reply = call(data, timeout=5)
        return next(iter(reply)) if stream else reply


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(
    ("data", "reason"), [(BAD_UTF8, "bad UTF-8"), (b"\xff\xff\xff", "Error parsing message")]
)
def test_undecodable_requests_are_invalid_arguments(target, stream, data, reason):
    with pytest.raises(grpc.RpcError) as err:
        raw_call(target, WATCH if stream else CHECK, data, stream)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot decode the /grpc.health.v1.Health/" in err.value.details()
    assert reason in err.value.details()
    good = health_pb2.HealthCheckRequest(service="").SerializeToString()
    reply = health_pb2.HealthCheckResponse.FromString(raw_call(target, CHECK, good))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
