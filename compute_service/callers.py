"""Who may call which Compute RPC under mutual TLS (common.authz): only the gateway attaches the pool and
runs steps; an operator may read the model's shape and load or unload LoRA adapters. Over a unix socket or
--insecure every caller may."""

from common.authz import GATEWAY, OPERATORS, table
from protos import compute_pb2

SERVICE = compute_pb2.DESCRIPTOR.services_by_name["Compute"]

CALLERS = table(
    SERVICE.full_name,
    {
        "GetModelInfo": OPERATORS,
        "AttachPool": GATEWAY,
        "Forward": GATEWAY,
        "ForwardSteps": GATEWAY,
        "LoadLoraAdapter": OPERATORS,
        "UnloadLoraAdapter": OPERATORS,
    },
    [method.name for method in SERVICE.methods],
)
