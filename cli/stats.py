"""`pagedserve stats`: the cache service's GetStats as a table (a row per KV group: its layers, window and
blocks held), or JSON with --json; with --compute-target,
compute's model, dtype, weights mode, KV dtype and attention backend too (rows `compute.*`), and its execution
plan: what runs each stage of a step, and why (rows `compute.plan.*`)."""

import argparse
import json
import sys

import grpc

from common import transport
from common.server import channel
from protos import cache_pb2, cache_pb2_grpc, compute_pb2, compute_pb2_grpc

# What --compute-target adds from compute's GetModelInfo.
COMPUTE_FIELDS = ("model", "dtype", "weights", "kv_dtype", "attention_backend")


def add_parser(commands) -> None:
    p = commands.add_parser("stats")
    p.add_argument(
        "--cache-target",
        default="127.0.0.1:50052",
        help="cache service address HOST:PORT, or unix:PATH (`pagedserve up`: unix:RUNTIME_DIR/cache.sock)",
    )
    p.add_argument(
        "--compute-target",
        help="also compute's model info (weights mode, dtypes): HOST:PORT or unix:PATH (`pagedserve up`: "
        "unix:RUNTIME_DIR/compute.sock)",
    )
    transport.add_client_certs(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        fields = _plain(_cache_stats(args))
        if args.compute_target:
            info = _model_info(args)
            fields["compute"] = {name: getattr(info, name) for name in COMPUTE_FIELDS}
            fields["compute"]["execution_plan"] = _plan(info.execution_plan)
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(fields))
        return 0
    # The tier's message (kv_tier) becomes one row per field: kv_tier.hit_blocks, ...; so do the image store's
    # (image_store.hits, ...) and compute's, and its plan one row per stage: compute.plan.layers, ...
    rows = {}
    for name, value in fields.items():
        if name in ("kv_tier", "image_store", "compute"):
            rows.update({f"{name}.{inner}": inner_value for inner, inner_value in value.items()})
        elif name == "kv_groups":
            rows.update({f"kv_groups.{i}": _group_row(group) for i, group in enumerate(value)})
        else:
            rows[name] = value
    if "compute.execution_plan" in rows:
        rows.update(_plan_rows(rows.pop("compute.execution_plan")))
    width = max(map(len, rows))
    for name, value in rows.items():
        print(f"{name:<{width}}  {value}")
    return 0


def _cache_stats(args: argparse.Namespace) -> cache_pb2.CacheStats:
    with channel(args.cache_target, transport.credentials_of(args)) as ch:
        return cache_pb2_grpc.CacheStub(ch).GetStats(cache_pb2.GetStatsRequest(), timeout=args.timeout)


def _model_info(args: argparse.Namespace) -> compute_pb2.ModelInfo:
    with channel(args.compute_target, transport.credentials_of(args)) as ch:
        request = compute_pb2.GetModelInfoRequest()
        return compute_pb2_grpc.ComputeStub(ch).GetModelInfo(request, timeout=args.timeout)


def _plan(plan: compute_pb2.ExecutionPlan) -> dict:
    """The plan as plain values: what it was resolved for, and each stage's implementation and reason."""
    stages = {s.stage: {"implementation": s.implementation, "reason": s.reason} for s in plan.stages}
    return {
        "architecture": plan.architecture,
        "device": plan.device,
        "isa": plan.isa,
        "native_kernels": plan.native_kernels,
        "stages": stages,
    }


def _plan_rows(plan: dict) -> dict:
    rows = {f"compute.plan.{name}": value for name, value in plan.items() if name != "stages"}
    for stage, choice in plan["stages"].items():
        rows[f"compute.plan.{stage}"] = f"{choice['implementation']} ({choice['reason']})"
    return rows


def _group_row(group: dict) -> str:
    window = f"a {group['window']}-token window" if group["window"] else "full attention"
    return f"{group['num_layers']} layers, {window}, {group['held_blocks']} blocks held"


def _plain(message) -> dict:
    """The message's fields as plain values: map fields (allocator_stats) as dicts, message fields
    (kv_tier) as dicts of their fields, left out when unset, repeated ones (kv_groups) as lists of them."""
    fields = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            fields[field.name] = dict(value)
        elif field.message_type is not None and field.is_repeated:
            fields[field.name] = [_plain(item) for item in value]
        elif field.message_type is not None:
            if message.HasField(field.name):
                fields[field.name] = _plain(value)
        else:
            fields[field.name] = value
    return fields
