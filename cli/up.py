"""`pagedserve up`: the three services as separate processes, in the foreground, supervised: one that exits
is restarted; Ctrl-C/SIGTERM drains the gateway, then stops compute and cache.

Cache and compute listen only on unix sockets in a 0700 runtime directory (cli.runtime_dir): `up` opens no
TCP port but the gateway's (and /metrics ones when asked).
"""

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from cache_service.options import OPTIONS as CACHE
from cache_service.tiers.options import setting as tier_setting
from cli import runtime_dir
from cli.metrics_ports import SERVICES, metrics_port
from cli.roles import add_roles, internal, refuse_roles, services
from cli.supervisor import RestartPolicy, Supervisor
from common import shm_files
from common.healthcheck import serving
from compute_service.options import OPTIONS as COMPUTE
from compute_service.standby import FLAG as STANDBY_FLAG
from gateway.options import OPTIONS as GATEWAY
from gateway.options import UP_HTTP_PORT
from gateway.tls import TlsError, probe_credentials

START_TIMEOUT_S = 900.0
# How often `up` looks for a service that exited (its restart is due at the same ticks), and how often it
# probes the services not serving yet. NOTE: at 0.5 s, a compute killed under `up` waited 0.5 s on average
# (up to 1 s) more than its restart delay.
TICK_S, PROBE_S = 0.1, 0.5
# How long past --drain-timeout (the cache: past --kv-tier-flush-timeout) a service may take to stop.
DRAIN_MARGIN_S = 10.0
# Where cache and compute bind /metrics (when asked): this machine only.
INTERNAL_HOST = "127.0.0.1"
# Their command lines, in start order.
OPTIONS = {"cache": CACHE, "compute": COMPUTE, "gateway": GATEWAY}


def add_parser(commands) -> None:
    p = commands.add_parser("up")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway binds")
    p.add_argument("--port", type=int, default=GATEWAY.port)
    p.add_argument(
        "--http-port",
        type=int,
        default=UP_HTTP_PORT,
        help="the gateway's OpenAI-compatible HTTP API (0: off)",
    )
    p.add_argument(
        "--runtime-dir",
        help="0700 directory for the cache and compute unix sockets "
        "(default: $XDG_RUNTIME_DIR/pagedserve-PORT, else /tmp/pagedserve-UID-PORT)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus /metrics on BASE (gateway), BASE+1 (cache), BASE+2 (compute); 0 is off",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_restarts,
        help="stop the stack when a service exits more often than this within the window",
    )
    p.add_argument(
        "--restart-window",
        type=float,
        default=RestartPolicy.window_s,
        help="seconds over which --max-restarts counts a service's exits",
    )
    p.add_argument(
        "--compute-standby",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a second compute process loaded that takes over at once when compute exits (default: on "
        "for a --kv-device cpu compute of one rank; it costs a second copy of the model's memory)",
    )
    add_roles(p)
    # Every service setting, each declaration once (the model and the log flags serve several services).
    for add in dict.fromkeys(add for options in OPTIONS.values() for add in options.settings):
        add(p)
    p.set_defaults(run=run)


def runtime_path(args: argparse.Namespace) -> Path:
    return Path(args.runtime_dir) if args.runtime_dir else runtime_dir.default_path(args.port)


def internal_targets(args: argparse.Namespace) -> dict[str, str]:
    """The gRPC targets of cache and compute (and the prefill compute): unix sockets in the runtime
    directory."""
    return {name: f"unix:{runtime_dir.socket_path(runtime_path(args), name)}" for name in internal(args)}


def _placement(args: argparse.Namespace) -> dict[str, list[str]]:
    """Where each service listens, and whom the gateway calls: the flags `up` decides itself."""
    metrics = {
        name: str(metrics_port(args.metrics_port, name) if args.metrics_port else 0) for name in SERVICES
    }
    targets = internal_targets(args)
    # NOTE: the prefill compute serves no /metrics: BASE+2 is the compute's (docs/scaling.md).
    placement = {
        name: ["--host", INTERNAL_HOST, "--socket", str(runtime_dir.socket_path(runtime_path(args), name)),
               "--metrics-port", metrics.get(name, "0")]
        for name in internal(args)
    }  # fmt: skip
    placement["gateway"] = ["--host", args.host, "--port", str(args.port), "--http-port", str(args.http_port),
                            "--metrics-port",
                            metrics["gateway"], "--cache-target", targets["cache"],
                            "--compute-target", targets["compute"]]  # fmt: skip
    if "prefill" in targets:
        placement["gateway"] += ["--prefill-compute-target", targets["prefill"]]
    return placement


def service_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The command line of each service, in start order: its placement, then its settings as given to up."""
    placement = _placement(args)
    return {
        name: [sys.executable, "-m", options.module, *placement[name], *options.command_line(args)]
        for name, options in services(args, OPTIONS).items()
    }


def standby_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The compute standby's command line (compute_service/standby.py), when there is one: compute's own."""
    wanted = args.compute_standby
    if wanted is None:
        wanted = args.kv_device.type == "cpu" and args.tensor_parallel_size == 1
    return {"compute": [*service_commands(args)["compute"], STANDBY_FLAG]} if wanted else {}


def stop_timeouts(args: argparse.Namespace) -> dict[str, float]:
    """How long each service may take to stop before it is killed: the gateway its drain, the cache its
    tier's flush (see cache_service.tiers.manager.StopFlush), each plus a margin."""
    return {
        "gateway": args.drain_timeout + DRAIN_MARGIN_S,
        "cache": tier_setting(args, "kv_tier_flush_timeout") + DRAIN_MARGIN_S,
    }


def _remove_segments(name: str, pid: int) -> None:
    """A cache that exited without unlinking its pool segment (kill -9) leaves it: remove it."""
    if name == "cache":
        for path in shm_files.remove_segments_of(pid):
            print(f"pagedserve: removed {path}, left by the cache (pid {pid})", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    refusal = refuse_roles(args)
    if not refusal and args.compute_standby and args.tensor_parallel_size > 1:
        refusal = "--compute-standby serves one rank: leave it out with --tensor-parallel-size"
    if refusal:
        print(f"pagedserve: {refusal}", file=sys.stderr)
        return 2
    path = runtime_path(args)
    try:
        created = runtime_dir.prepare(path)
    except (runtime_dir.UnsafeRuntimeDir, OSError) as err:
        print(f"pagedserve: {err}", file=sys.stderr)
        return 2
    try:
        return _supervise(args)
    finally:
        runtime_dir.clean(path, created)


def _supervise(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    targets = {**internal_targets(args), "gateway": f"{local}:{args.port}"}
    probes = {name: {} for name in targets}
    if args.tls_cert is not None:
        try:
            credentials, options = probe_credentials(args.tls_cert)
        except TlsError as err:
            print(f"pagedserve: {err}", file=sys.stderr)
            return 2
        probes["gateway"] = {"credentials": credentials, "options": options}
    policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window)
    supervisor = Supervisor(
        service_commands(args), policy, on_exit=_remove_segments, standbys=standby_commands(args)
    )
    supervisor.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(targets)
    code = 0
    probe_at = 0.0
    while not stop.is_set():
        if supervisor.check():
            code = 1
            break
        if pending and time.monotonic() >= probe_at:
            pending = {name for name in pending if not serving(targets[name], **probes[name])}
            probe_at = time.monotonic() + PROBE_S
        if not pending and deadline:
            sockets = runtime_path(args)
            print(f"pagedserve ready on {local}:{args.port} (model {args.model}, {args.dtype}, "
                  f"KV {args.kv_dtype} on {args.kv_device}; cache and compute sockets in {sockets})",
                  flush=True)  # fmt: skip
            if args.http_port:
                scheme = "https" if args.tls_cert is not None else "http"
                print(f"OpenAI-compatible API on {scheme}://{local}:{args.http_port}/v1", flush=True)
            deadline = 0.0
            supervisor.arm_standbys()
        if deadline and time.monotonic() > deadline:
            print(
                f"pagedserve: {', '.join(sorted(pending))} not healthy after {START_TIMEOUT_S:.0f}s",
                file=sys.stderr,
            )
            code = 1
            break
        stop.wait(TICK_S)
    supervisor.stop(stop_timeouts(args))
    return code
