"""`pagedserve up --prefill-computes N --decode-computes M`: computes by role on this host (docs/scaling.md).
The decode compute is the service `compute`; a prefill compute is the service `prefill`, the same compute
service with the same settings on a socket of its own, attached by the gateway to the same pool."""

import argparse

from common.options import ServiceOptions

# What one host serves: one decode compute, and at most one prefill compute beside it.
MAX_PREFILL_COMPUTES, DECODE_COMPUTES = 1, 1


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute count (an integer >= 0)")
    return int(text)


def add_roles(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill-computes",
        type=_count,
        default=0,
        help="compute processes that run long prompt chunks only, attached to the same pool (0 or 1): the "
        "decodes go on beside them; see --prefill-threshold (docs/scaling.md)",
    )
    parser.add_argument(
        "--decode-computes",
        type=_count,
        default=DECODE_COMPUTES,
        help=f"compute processes that run the decode steps (and short prompts): {DECODE_COMPUTES} on a host",
    )


def refuse_roles(args: argparse.Namespace) -> str | None:
    """Why the roles asked cannot be served (one line), or None."""
    if args.decode_computes != DECODE_COMPUTES or args.prefill_computes > MAX_PREFILL_COMPUTES:
        return (
            f"--prefill-computes {args.prefill_computes} --decode-computes {args.decode_computes}: one host "
            f"serves {DECODE_COMPUTES} decode compute and 0 or {MAX_PREFILL_COMPUTES} prefill compute"
        )
    if not args.prefill_computes:
        return None
    if args.tensor_parallel_size > 1:
        return "--prefill-computes with --tensor-parallel-size > 1: a prefill compute serves one rank only"
    if args.enable_lora or args.lora_modules:
        return "--prefill-computes with LoRA adapters: adapters load on the decode compute only"
    return None


def internal(args: argparse.Namespace) -> tuple[str, ...]:
    """The services on unix sockets: cache and compute, and the prefill compute when asked."""
    return ("cache", "compute", "prefill") if args.prefill_computes else ("cache", "compute")


def services(args: argparse.Namespace, options: dict[str, ServiceOptions]) -> dict[str, ServiceOptions]:
    """Each service's options, in start order: the prefill compute right after the compute."""
    if not args.prefill_computes:
        return options
    ordered = {}
    for name, service in options.items():
        ordered[name] = service
        if name == "compute":
            ordered["prefill"] = service
    return ordered
