"""The pagedserve.v1.Cache gRPC service: one KV pool and its block manager (cache_service.servicer), the
flags, the sweeper that lapses sessions on time, metrics."""

import argparse
import threading
import time
from collections.abc import Sequence

from cache_service import device_room, metrics
from cache_service.allocators import registry
from cache_service.callers import CALLERS
from cache_service.kv_events import publisher as kv_events
from cache_service.kv_events.options import events_config
from cache_service.options import DEFAULT_KV_MEMORY, DEFAULT_SESSION_TTL_S, OPTIONS
from cache_service.servicer import CacheServicer
from cache_service.sessions import Sessions
from cache_service.tiers import manager as tiers
from cache_service.tiers.base import TierError
from cache_service.tiers.options import resolve as resolve_tier
from common import shm_files, transport
from common.errors import InvalidArgument
from common.logging import configure
from common.metrics import serve_metrics
from common.server import serve
from protos import cache_pb2, cache_pb2_grpc

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name
# How often lapsed sessions are looked for when no call arrives.
SWEEP_INTERVAL_S = 0.5


def _sweep_every(servicer: CacheServicer, interval_s: float) -> None:
    """Lapses sessions on time even when no call arrives (a daemon thread: ends with the process)."""
    while True:
        time.sleep(interval_s)
        servicer.sweep()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = OPTIONS.parser(__doc__)
    args = parser.parse_args(argv)
    try:
        registry.resolve(args.allocator)
    except InvalidArgument as err:
        parser.error(str(err))
    transport.check_listen(parser, args)
    try:
        resolve_tier(args)
        events_config(args)
    except ValueError as err:
        parser.error(str(err))
    if args.kv_blocks is None and args.kv_memory is None:
        args.kv_memory = DEFAULT_KV_MEMORY
    refusal = device_room.refusal(args.kv_device, args.kv_memory or 0, args.kv_tier)
    if refusal:
        parser.error(refusal)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    log = configure("cache", args.log_format, args.log_level)
    removed = shm_files.sweep_stale()
    log.info("swept_stale_segments", count=len(removed), paths=[str(path) for path in removed])
    try:
        tier = tiers.from_args(args, log)
    except TierError as err:
        raise SystemExit(f"cache_service: --kv-tier {args.kv_tier}: {err}") from err
    events = kv_events.from_args(args, log)
    sessions = Sessions(min(DEFAULT_SESSION_TTL_S, args.max_session_ttl), args.max_session_ttl)
    servicer = CacheServicer(
        args.allocator,
        args.kv_blocks or 0,
        args.kv_memory or 0,
        log,
        args.prefix_cache,
        sessions,
        args.debug_read_kv,
        tier,
        args.kv_device,
        events,
        args.image_store_memory,
    )
    sweeper = threading.Thread(target=_sweep_every, args=(servicer, SWEEP_INTERVAL_S), daemon=True)
    sweeper.start()
    metrics.register(lambda: servicer.GetStats(cache_pb2.GetStatsRequest(), None))
    serve_metrics(args.host, args.metrics_port, log)
    server = serve(
        [(cache_pb2_grpc.add_CacheServicer_to_server, servicer, SERVICE_NAME)],
        args.host,
        args.port,
        log,
        serving=False,
        **transport.listen(args, "cache", CALLERS, log),
    )
    server.handle_signals()
    server.set_serving(SERVICE_NAME, True)
    server.wait(on_stop=servicer.close)
