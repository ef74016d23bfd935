"""`pagedserve`: start the stack, generate from the terminal."""

import argparse

from gateway.cli import generate, monitor, stats, up


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: a paged-KV LLM inference server"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (up, generate, monitor, stats):
        module.add_parser(commands)
    args = parser.parse_args(argv)
    raise SystemExit(args.run(args))
