"""`python -m common.healthcheck HOST:PORT [SERVICE]`: exit 0 if grpc.health.v1 answers SERVING, else 1.

For container health checks (docker-compose.yml): no grpcurl or proto files needed in the image.
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 3.0) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as err:
            print(f"{target}: {err.code().name}: {err.details()}", file=sys.stderr)
            return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target} {service or '(server)'}: {status}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if check(*argv) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
