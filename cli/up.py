"""`pagedserve up`: the three services as separate processes, in the foreground, stopped together."""

import argparse
import signal
import subprocess
import sys
import threading
import time

from common.healthcheck import serving
from common.model_files import DEFAULT_MODEL
from common.precision import DTYPE_CHOICES

START_TIMEOUT_S = 900.0
SERVICES = ("gateway", "cache", "compute")


def add_parser(commands) -> None:
    p = commands.add_parser("up", help="start cache, compute and gateway services and wait for Ctrl-C")
    p.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file or HF directory (default: SmolLM2-135M)")
    p.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: bfloat16 where the CPU has native bf16"
    )
    p.add_argument("--block-size", type=int, default=16)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-blocks", type=int, help="KV pool size in blocks")
    budget.add_argument("--kv-memory", help="KV pool size in bytes, e.g. 512MiB (default 256MiB)")
    p.add_argument(
        "--allocator", default="freelist", help="block allocator: freelist, bitmap, contiguous, ..."
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    p.add_argument(
        "--plain-linear", action="store_true", help="compute keeps nn.Linear (no small-batch W·xᵀ path)"
    )
    p.add_argument("--max-batched-tokens", type=int, default=4096)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--host", default="127.0.0.1", help="address the gateway binds")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--cache-port", type=int, default=50052)
    p.add_argument("--compute-port", type=int, default=50053)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus /metrics on BASE (gateway), BASE+1 (cache), BASE+2 (compute); 0 is off",
    )
    p.add_argument("--log-format", choices=("console", "json"), default="console")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.set_defaults(run=run)


def service_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The command line of each service, in start order."""
    log = ["--log-format", args.log_format, "--log-level", args.log_level]
    base = args.metrics_port
    metrics = {name: ["--metrics-port", str(base + i if base else 0)] for i, name in enumerate(SERVICES)}
    budget = ["--kv-blocks", str(args.kv_blocks)] if args.kv_blocks else []
    budget += ["--kv-memory", args.kv_memory] if args.kv_memory else []
    cache = f"127.0.0.1:{args.cache_port}"
    compute = f"127.0.0.1:{args.compute_port}"
    py = [sys.executable, "-m"]
    return {
        "cache": [
            *py,
            "cache_service",
            "--port",
            str(args.cache_port),
            "--allocator",
            args.allocator,
            *budget,
            *metrics["cache"],
            *log,
            *(["--no-prefix-cache"] if args.no_prefix_cache else []),
        ],
        "compute": [
            *py,
            "compute_service",
            "--model",
            args.model,
            "--dtype",
            args.dtype,
            "--port",
            str(args.compute_port),
            *metrics["compute"],
            *log,
            *(["--plain-linear"] if args.plain_linear else []),
        ],
        "gateway": [
            *py,
            "gateway",
            "--model",
            args.model,
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--cache-target",
            cache,
            "--compute-target",
            compute,
            "--block-size",
            str(args.block_size),
            "--max-batched-tokens",
            str(args.max_batched_tokens),
            "--max-seqs",
            str(args.max_seqs),
            *metrics["gateway"],
            *log,
        ],
    }


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    for proc in reversed(procs.values()):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    targets = {
        "cache": f"127.0.0.1:{args.cache_port}",
        "compute": f"127.0.0.1:{args.compute_port}",
        "gateway": f"{local}:{args.port}",
    }
    # NOTE: own sessions, so Ctrl-C reaches only this launcher and shutdown runs gateway → compute → cache.
    procs = {
        name: subprocess.Popen(cmd, start_new_session=True) for name, cmd in service_commands(args).items()
    }
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(procs)
    code = 0
    while not stop.is_set():
        dead = [name for name, proc in procs.items() if proc.poll() is not None]
        if dead:
            print(f"pagedserve: {', '.join(dead)} exited; stopping the stack", file=sys.stderr)
            code = 1
            break
        pending = {name for name in pending if not serving(targets[name])}
        if not pending and deadline:
            print(f"pagedserve ready on {local}:{args.port} (model {args.model}, {args.dtype})", flush=True)
            deadline = 0.0
        if deadline and time.monotonic() > deadline:
            print(
                f"pagedserve: {', '.join(sorted(pending))} not healthy after {START_TIMEOUT_S:.0f}s",
                file=sys.stderr,
            )
            code = 1
            break
        stop.wait(0.5)
    _stop_all(procs)
    return code
