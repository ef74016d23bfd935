"""The one grpc.health.v1 probe: `serving(target, service)` for launchers, tests and the gateway's watcher.

`python -m common.healthcheck [--internal-certs DIR --identity NAME] TARGET [SERVICE]` exits 0 if the server
at TARGET (HOST:PORT or unix:PATH) answers SERVING, else 1: for container health checks (docker-compose.yml),
no grpcurl or proto files needed in the image.
"""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import transport
from common.server import channel

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
    with channel(target, credentials, options) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def serving(target: str, service: str = "", timeout: float = 1.0, **channel) -> bool:
    """True when the server at target answers SERVING for service within timeout seconds (`channel`:
    status's credentials and options)."""
    return status(target, service, timeout, **channel) == SERVING


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(prog="python -m common.healthcheck", description=__doc__)
    result.add_argument("target", help="HOST:PORT or unix:PATH")
    result.add_argument("service", nargs="?", default="", help="the service to ask about ('': the server)")
    transport.add_client_certs(result)
    return result


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    reply = status(args.target, args.service, timeout=3.0, credentials=transport.credentials_of(args))
    out = sys.stdout if reply == SERVING else sys.stderr
    print(f"{args.target} {args.service or '(server)'}: {reply}", file=out)
    return 0 if reply == SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
