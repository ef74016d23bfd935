"""`pagedserve embed TEXT...`: embeddings from a running stack, as JSON on stdout (one vector per input, in
order), a summary on stderr."""

import argparse
import json
import sys
from pathlib import Path

from cli.generate import DEFAULT_TARGET, add_connection_flags, connection_kwargs
from sdk.client import Client, GenerationError


def add_parser(commands) -> None:
    p = commands.add_parser(
        "embed",
        description='Prints {"model", "embeddings": [[...], ...], "usage"} as JSON, one embedding per '
        "input in order; a summary goes to stderr (docs/embeddings.md).",
    )
    p.add_argument("text", nargs="*", help="the inputs, each embedded alone")
    p.add_argument(
        "--file", type=Path, help="also embed each line of this file (- for stdin) as an input of its own"
    )
    p.add_argument(
        "--dimensions", type=int, default=None, help="truncate to this many (where the model allows)"
    )
    p.add_argument("--priority", type=int, default=0, help="lower is served first (default 0)")
    p.add_argument(
        "--lora-adapter",
        default="",
        metavar="NAME",
        help="embed through this LoRA adapter, by name (docs/adapters.md); default: the base model",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"gateway HOST:PORT (default {DEFAULT_TARGET})")
    p.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    add_connection_flags(p)
    p.set_defaults(run=run)


def _inputs(args: argparse.Namespace) -> list[str]:
    """The texts given, then the file's lines (OSError if it cannot be read)."""
    lines: list[str] = []
    if args.file is not None:
        text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text()
        lines = [line for line in text.splitlines() if line]
    return [*args.text, *lines]


def run(args: argparse.Namespace) -> int:
    try:
        inputs = _inputs(args)
    except OSError as err:
        print(f"error: cannot read --file {args.file}: {err.strerror}", file=sys.stderr)
        return 2
    if not inputs:
        print("error: no input: give texts, or --file", file=sys.stderr)
        return 2
    try:
        client = Client(args.target, timeout=args.timeout, **connection_kwargs(args))
    except OSError as err:
        print(f"error: cannot read --tls-ca {args.tls_ca}: {err.strerror}", file=sys.stderr)
        return 2
    with client:
        try:
            result = client.embed(
                inputs, dimensions=args.dimensions, priority=args.priority, lora_adapter=args.lora_adapter
            )
        except GenerationError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    usage = {"prompt_tokens": result.usage.prompt_tokens, "cached_tokens": result.usage.cached_tokens}
    json.dump({"model": result.model, "embeddings": result.vectors, "usage": usage}, sys.stdout)
    print()
    width = len(result.vectors[0]) if result.vectors else 0
    print(
        f"[{len(result.vectors)} embeddings of {width} dimensions; {usage['prompt_tokens']} prompt tokens "
        f"({usage['cached_tokens']} cached)]",
        file=sys.stderr,
    )
    return 0
