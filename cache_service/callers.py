"""Who may call which Cache RPC under mutual TLS (common.authz): only the gateway changes blocks, sessions,
image leases or the pool; an operator may read statistics, blocks and the block map. Over a unix socket or
--insecure every caller may."""

from common.authz import GATEWAY, OPERATORS, table
from protos import cache_pb2

SERVICE = cache_pb2.DESCRIPTOR.services_by_name["Cache"]

CALLERS = table(
    SERVICE.full_name,
    {
        "CreatePool": GATEWAY,
        "Reserve": GATEWAY,
        "Lookup": GATEWAY,
        "Fork": GATEWAY,
        "Free": GATEWAY,
        "OpenSession": GATEWAY,
        "RenewSession": GATEWAY,
        "CloseSession": GATEWAY,
        "AcquireImages": GATEWAY,
        "ReleaseImages": GATEWAY,
        "GetStats": OPERATORS,
        "ReadBlock": OPERATORS,
        "GetBlockMap": OPERATORS,
    },
    [method.name for method in SERVICE.methods],
)
