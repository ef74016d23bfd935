"""`pagedserve bench --workload NAME`: a workload through the public API, the peers on the same prompts."""

import argparse
import json
import shutil
import sys
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from cache_service.tiers import registry as tiers
from cache_service.tiers.options import add_tier_settings
from cli.bench import client_race, driver, embeddings, engines, peers, profile, report, roofline, shapes, soak
from cli.bench.workloads import WORKLOADS, Workload, build
from cli.launch import Stack
from cli.scrape import scrape
from common.cpu import describe
from common.model_files import DEFAULT_MODEL
from common.options import ServiceOptions, add_dtype, add_kv_dtype, add_model
from compute_service.weight_modes import WEIGHTS_CHOICES
from gateway.options import add_step_sizing
from sdk.client import Client

# The cache's KV tier flags, forwarded to the stacks the bench starts (those given only).
TIER = ServiceOptions("cache_service", 0, settings=(add_tier_settings,))
# The gateway's step sizing flags, likewise (to compare a stack's scheduling settings).
STEP_SIZING = ServiceOptions("gateway", 0, settings=(add_step_sizing,))
# compute's counters of prompt-lookup drafts (compute_service/speculation.py)
DRAFTED, DRAFTS_KEPT = "pagedserve_draft_tokens_total", "pagedserve_draft_tokens_accepted_total"
STEP_SIZING_FLAGS = (
    "--prefill-tokens-with-decodes/--decode-step-target-ms/--pace-streams/--decode-steps/--draft-tokens"
)


def add_parser(commands) -> None:
    p = commands.add_parser("bench")
    p.add_argument("--workload", choices=[*WORKLOADS, soak.NAME, embeddings.NAME])
    client_race.add_flags(p)
    p.add_argument("--target", help="gateway HOST:PORT of a running stack (default: start one)")
    p.add_argument(
        "--cache-target",
        default="127.0.0.1:50052",
        help="its cache service (HOST:PORT or unix:PATH), with --target",
    )
    add_model(p)
    p.add_argument(
        "--model-shape", choices=list(shapes.SHAPES),
        help="instead of --model, random weights in this published model's shape (built once in the cache), "
        f"for every engine alike; without it, --model (by default the shipped {shapes.DEFAULT_SHAPE})",
    )  # fmt: skip
    add_dtype(p)
    add_kv_dtype(p)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1, help="passes; figures are medians")
    p.add_argument("--no-peers", action="store_true", help="skip generate_batch and generate")
    engines.add_flags(p)
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
    p.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default="auto",
        help="the stack's compute --weights (int8, int4)",
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    soak.add_flags(p)
    add_tier_settings(p)
    add_step_sizing(p)
    p.add_argument(
        "--cold-restart",
        action="store_true",
        help="a warm-up pass, then each pass on a restarted stack with the warm-up's cache salt: the KV tier "
        "(not the pool) serves the prompts it kept; --kv-tier without --kv-tier-path uses a temporary one",
    )
    p.set_defaults(run=run)


def _measure(
    args, workload, target: str, cache_target: str, metrics_url: str | None, compute_url: str | None
) -> dict:
    """The workload's median figures and, with --profile, the mean step split over all passes; with
    --draft-tokens on a stack the bench started (compute's /metrics at `compute_url`), the share of the
    drafts fed over all passes that the steps kept."""
    before = profile.totals(scrape(metrics_url)) if args.profile else None
    drafts = _draft_counts(compute_url) if args.draft_tokens and compute_url else None
    figures = {"pagedserve": _passes(args, workload, target, cache_target, workload.name)}
    if args.profile:
        figures["profile"] = profile.summarize(before, profile.totals(scrape(metrics_url)))
    if drafts is not None:
        fed, kept = (after - then for after, then in zip(_draft_counts(compute_url), drafts, strict=True))
        figures["pagedserve"]["drafts_kept"] = kept / fed if fed else None
    return figures


def _draft_counts(compute_url: str) -> tuple[float, float]:
    """Compute's counts of prompt-lookup drafts fed and kept so far."""
    samples = scrape(compute_url)
    return samples[DRAFTED, ()], samples[DRAFTS_KEPT, ()]


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
    flags.
    NOTE: without compute's standby: it would load (seconds of CPU, at a lower priority) while the first runs
    are measured; once loaded it waits without using any, so the stack serves alike with or without it."""
    linear = ["--plain-linear"] if args.plain_linear else []
    return Stack.start(
        "--model", args.model, "--dtype", args.dtype, "--kv-dtype", args.kv_dtype,
        "--block-size", str(args.block_size), "--weights", args.weights, *linear, *TIER.command_line(args),
        *STEP_SIZING.command_line(args), "--no-compute-standby", *flags,
    )  # fmt: skip


def _cold_passes(args, workload: Workload, stack: Stack) -> dict:
    """A warm-up pass on stack, which it then stops; then --repeat passes, each on a stack of its own (same
    flags, same tier storage) and on the warm-up's cache salt; their median figures."""
    salt = uuid.uuid4().hex
    driver.run(workload, stack.target, stack.cache_target, salt=salt)
    stack.stop()
    runs = []
    for _ in tqdm(range(args.repeat), desc=f"{workload.name}, cold restarts", file=sys.stderr):
        fresh = _start(args, *workload.stack_flags(args.block_size))
        try:
            runs.append(driver.run(workload, fresh.target, fresh.cache_target, salt=salt))
        finally:
            fresh.stop()
    return driver.median_of(runs)


def _shape_label(args) -> str:
    return f" (model shape {args.model_shape}, random weights)" if args.model_shape else ""


def _sizing_label(args) -> str:
    flags = STEP_SIZING.command_line(args)
    return f", {' '.join(flags)}" if flags else ""


def _tiered(args) -> bool:
    return args.kv_tier not in (None, tiers.NONE)


def _tier_label(args) -> str:
    if _tiered(args):
        return f"KV tier {args.kv_tier}"
    return f"KV tier per {args.config}" if args.config else "no KV tier"


def _check(args) -> None:
    """SystemExit for flags that do not go together."""
    client_race.check_flags(args)
    engines.check_flags(args)
    soak.check_flags(args)
    if args.model_shape and args.model != DEFAULT_MODEL:
        raise SystemExit("pagedserve bench: --model-shape makes the model; drop --model")
    if args.profile and args.target and not args.metrics_url:
        raise SystemExit("pagedserve bench: --profile with --target needs the gateway's --metrics-url")
    for flag, given in (
        ("--plain-linear", args.plain_linear),
        ("--weights", args.weights != "auto"),
        ("--cold-restart", args.cold_restart),
        ("--kv-tier/--config", TIER.command_line(args)),
        (STEP_SIZING_FLAGS, STEP_SIZING.command_line(args)),
        ("--model-shape", args.model_shape),
    ):
        if given and args.target:
            raise SystemExit(f"pagedserve bench: {flag} applies to a stack the bench starts, not --target")
    if args.cold_restart and args.profile:
        raise SystemExit("pagedserve bench: --profile reads one stack's metrics; drop it with --cold-restart")


def run(args: argparse.Namespace) -> int:
    _check(args)
    from_file = args.config.settings if args.config else {}
    temporary = _tiered(args) and not args.kv_tier_path and "kv_tier_path" not in from_file
    if temporary and args.kv_tier == "redis":
        raise SystemExit("pagedserve bench: --kv-tier redis needs --kv-tier-path redis://HOST:PORT/DB")
    if temporary:
        args.kv_tier_path = tempfile.mkdtemp(prefix="pagedserve-bench-tier-")
    if args.model_shape:
        print(f"model shape {args.model_shape}: random weights (built once)", file=sys.stderr)
        args.model = str(shapes.model_dir(args.model_shape))
    try:
        if args.client:
            return _client(args)
        if args.workload == embeddings.NAME:
            return _embeddings(args)
        return _soak(args) if args.workload == soak.NAME else _run(args)
    finally:
        if temporary:
            shutil.rmtree(args.kv_tier_path, ignore_errors=True)


def _soak(args: argparse.Namespace) -> int:
    result = soak.run(args, lambda: _start(args))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _client(args: argparse.Namespace) -> int:
    result = client_race.run(args, lambda: _start(args))
    print(client_race.table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _embeddings(args: argparse.Namespace) -> int:
    result = embeddings.run(args, lambda *flags: _start(args, *flags))
    print(embeddings.table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _run(args: argparse.Namespace) -> int:
    stack = None
    compute_url = None
    # NOTE: measured before the stack starts, on this machine's idle cores (a --target may be another's)
    ceilings = None if args.target else roofline.measure_ceilings()
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
        if stack is not None:
            compute_url = stack.metrics_url("compute")
        result = {
            "workload": workload.name,
            "description": workload.description,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": describe(),
            "model_shape": args.model_shape,
            "setup": f"{info.model}{_shape_label(args)}, {info.dtype}, weights {info.weights or info.dtype}, "
            f"KV {info.kv_dtype}"
            f"{', plain nn.Linear' if args.plain_linear else ''}, "
            f"block size {info.block_size}, {_tier_label(args)}{_sizing_label(args)}"
            f"{', cold restarts' if args.cold_restart else ''}, median of {args.repeat}",
            "block_size": info.block_size,
            **(
                {"pagedserve": _cold_passes(args, workload, stack)}
                if args.cold_restart
                else _measure(args, workload, target, cache_target, metrics_url, compute_url)
            ),
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
    runs = {}
    if "vllm" in args.peer:
        runs["vllm"] = engines.vllm(args, workload, args.vllm_dtype or info.dtype)
    if "llamacpp" in args.peer:
        runs["llamacpp"] = engines.llamacpp(args, workload)
    for key, peer in runs.items():
        others[engines.PEERS[key]] = peer.figures
        result[f"{key}_setup"] = peer.setup
        result.setdefault("peer_settings", {})[engines.PEERS[key]] = peer.settings
    if not args.no_peers:
        others = {**_peers(args, workload, info.dtype), **others}
    if others:
        result["peers"] = others
    if ceilings is not None:
        dtypes = {"dtype": info.dtype, "weights": info.weights or info.dtype, "kv_dtype": info.kv_dtype}
        roofline.add_to(
            result, args.model, ceilings, workload, {**dtypes, "vllm": args.vllm_dtype or info.dtype}
        )
    if others:
        result["ratios"] = report.ratios(result)
    print(report.table(result))
    if "profile" in result:
        print(profile.table(result["profile"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0
