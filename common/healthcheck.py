"""The one grpc.health.v1 probe: `serving(target, service)` for launchers, tests and the gateway's watcher.

`python -m common.healthcheck HOST:PORT [SERVICE]` exits 0 if the server answers SERVING, else 1: for
container health checks (docker-compose.yml), no grpcurl or proto files needed in the image.
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2.HealthCheckResponse.SERVING)


def status(
    target: str,
    service: str = "",
    timeout: float = 1.0,
    credentials: grpc.ChannelCredentials | None = None,
    options: tuple = (),
) -> str:
    """What the server at target reports for service ('' is the whole server): a ServingStatus name
    (SERVING, NOT_SERVING, ...), or the status code of the failed check (UNAVAILABLE, DEADLINE_EXCEEDED, ...).
    With credentials, over TLS.
    """
    if credentials is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, credentials, options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def serving(target: str, service: str = "", timeout: float = 1.0, **channel) -> bool:
    """True when the server at target answers SERVING for service within timeout seconds (`channel`:
    status's credentials and options)."""
    return status(target, service, timeout, **channel) == SERVING


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    target, service = argv[0], argv[1] if len(argv) == 2 else ""
    reply = status(target, service, timeout=3.0)
    print(f"{target} {service or '(server)'}: {reply}", file=sys.stdout if reply == SERVING else sys.stderr)
    return 0 if reply == SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
