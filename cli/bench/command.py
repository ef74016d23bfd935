"""`pagedserve bench --workload NAME`: a workload through the public API, the peers on the same prompts."""

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from cli.bench import driver, peers, profile, report
from cli.bench.workloads import WORKLOADS, build
from cli.launch import Stack
from cli.scrape import scrape
from common.options import add_dtype, add_kv_dtype, add_model
from sdk.client import Client


def add_parser(commands) -> None:
    p = commands.add_parser(
        "bench", help="measure a workload against transformers' generate_batch and generate"
    )
    p.add_argument("--workload", choices=list(WORKLOADS), required=True)
    p.add_argument("--target", help="gateway HOST:PORT of a running stack (default: start one)")
    p.add_argument(
        "--cache-target",
        default="127.0.0.1:50052",
        help="its cache service (HOST:PORT or unix:PATH), with --target",
    )
    add_model(p)
    add_dtype(p)
    add_kv_dtype(p)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1, help="passes; figures are medians")
    p.add_argument("--no-peers", action="store_true", help="skip generate_batch and generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile", action="store_true", help="split the steps' time into gateway and compute phases"
    )
    p.add_argument(
        "--metrics-url",
        help="the gateway's /metrics, for --profile with --target (e.g. http://127.0.0.1:9400/metrics)",
    )
    p.add_argument(
        "--plain-linear", action="store_true", help="the stack's compute keeps nn.Linear (for comparison)"
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.set_defaults(run=run)


def _measure(args, workload, target: str, cache_target: str, metrics_url: str | None) -> dict:
    """The workload's median figures and, with --profile, the mean step split over all passes."""
    before = profile.totals(scrape(metrics_url)) if args.profile else None
    figures = {"pagedserve": _passes(args, workload, target, cache_target, workload.name)}
    if args.profile:
        figures["profile"] = profile.summarize(before, profile.totals(scrape(metrics_url)))
    return figures


def _passes(args, workload, target: str, cache_target: str, desc: str) -> dict:
    """The median figures of --repeat passes of the workload against one stack."""
    total = sum(r.max_tokens for r in workload.requests) * args.repeat
    with tqdm(total=total, desc=desc, unit="tok", file=sys.stderr) as bar:
        runs = [driver.run(workload, target, cache_target, bar.update) for _ in range(args.repeat)]
    return driver.median_of(runs)


def _peers(args, workload, dtype: str) -> dict:
    model = peers.load(args.model, dtype)
    runs = {"generate_batch": [], "generate": []}
    for _ in tqdm(range(args.repeat), desc="peers", file=sys.stderr):
        runs["generate_batch"].append(peers.generate_batch(model, workload))
        runs["generate"].append(peers.generate_padded(model, workload))
    return {name: driver.median_of(values) for name, values in runs.items()}


def _start(args, *flags: str) -> Stack:
    """A stack of the bench's model, dtype, KV dtype, block size and linear path, with these extra `up`
    flags."""
    linear = ["--plain-linear"] if args.plain_linear else []
    return Stack.start(
        "--model", args.model, "--dtype", args.dtype, "--kv-dtype", args.kv_dtype,
        "--block-size", str(args.block_size), *linear, *flags,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.profile and args.target and not args.metrics_url:
        raise SystemExit("pagedserve bench: --profile with --target needs the gateway's --metrics-url")
    if args.plain_linear and args.target:
        raise SystemExit("pagedserve bench: --plain-linear applies to a stack the bench starts, not --target")
    stack = None
    if args.target:
        target, cache_target, metrics_url = args.target, args.cache_target, args.metrics_url
    else:
        stack = _start(args)
        target, cache_target, metrics_url = stack.target, stack.cache_target, stack.metrics_url()
    try:
        with Client(target) as client:
            info = client.info()
        workload = build(args.workload, info.vocab_size, args.seed)
        if stack is not None and workload.stack_flags(args.block_size):
            stack.stop()
            stack = _start(args, *workload.stack_flags(args.block_size))
            target, cache_target, metrics_url = stack.target, stack.cache_target, stack.metrics_url()
        result = {
            "workload": workload.name,
            "description": workload.description,
            "setup": f"{info.model}, {info.dtype}, KV {info.kv_dtype}"
            f"{', plain nn.Linear' if args.plain_linear else ''}, "
            f"block size {info.block_size}, median of {args.repeat}",
            "block_size": info.block_size,
            **_measure(args, workload, target, cache_target, metrics_url),
        }
        others = {}
        if stack is not None and workload.prefix_cache_off_peer:
            stack.stop()
            stack = _start(args, *workload.stack_flags(args.block_size), "--no-prefix-cache")
            off = report.PREFIX_CACHE_OFF
            others[off] = _passes(args, workload, stack.target, stack.cache_target, f"{workload.name}, {off}")
    finally:
        if stack is not None:
            stack.stop()
    if not args.no_peers:
        others = {**_peers(args, workload, info.dtype), **others}
    if others:
        result["peers"] = others
    print(report.table(result))
    if "profile" in result:
        print(profile.table(result["profile"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0
