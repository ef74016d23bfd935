"""`pagedserve`: start the stack, generate, benchmark, watch and inspect it from the terminal."""

import argparse

from cli import certs, generate, monitor, stats, up
from cli.bench import command as bench
from cli.bench import plot as bench_plot


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: a paged-KV LLM inference server"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (up, generate, bench, bench_plot, monitor, stats, certs):
        module.add_parser(commands)
    args = parser.parse_args(argv)
    raise SystemExit(args.run(args))


if __name__ == "__main__":
    main()
