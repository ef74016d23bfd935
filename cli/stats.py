"""`pagedserve stats`: the cache service's GetStats as a table, or JSON with --json."""

import argparse
import json
import sys

import grpc

from common import transport
from common.server import channel
from protos import cache_pb2, cache_pb2_grpc


def add_parser(commands) -> None:
    p = commands.add_parser("stats", help="print the cache service's block statistics")
    p.add_argument(
        "--cache-target",
        default="127.0.0.1:50052",
        help="cache service address HOST:PORT, or unix:PATH (`pagedserve up`: unix:RUNTIME_DIR/cache.sock)",
    )
    transport.add_client_certs(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with channel(args.cache_target, transport.credentials_of(args)) as ch:
        try:
            stats = cache_pb2_grpc.CacheStub(ch).GetStats(cache_pb2.GetStatsRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    fields = _plain(stats)
    if args.json:
        print(json.dumps(fields))
        return 0
    # The tier's message (kv_tier) becomes one row per field: kv_tier.hit_blocks, ...
    rows = {}
    for name, value in fields.items():
        if name == "kv_tier":
            rows.update({f"{name}.{inner}": tier_value for inner, tier_value in value.items()})
        else:
            rows[name] = value
    width = max(map(len, rows))
    for name, value in rows.items():
        print(f"{name:<{width}}  {value}")
    return 0


def _plain(message) -> dict:
    """The message's fields as plain values: map fields (allocator_stats) as dicts, message fields
    (kv_tier) as dicts of their fields, left out when unset."""
    fields = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            fields[field.name] = dict(value)
        elif field.message_type is not None:
            if message.HasField(field.name):
                fields[field.name] = _plain(value)
        else:
            fields[field.name] = value
    return fields
