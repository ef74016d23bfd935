"""`pagedserve`: start the stack, generate, benchmark, watch and inspect it from the terminal.

NOTE: a command's module is imported only when that command runs: the client commands (generate, stats,
monitor, certs) and --help then load no torch, transformers or bench code, and answer at once.
"""

import argparse
import importlib
import sys

# name -> (the module whose add_parser(commands) declares its flags and run, the line `--help` lists)
COMMANDS = {
    "up": ("cli.up", "start cache, compute and gateway services and wait for Ctrl-C"),
    "generate": ("cli.generate", "stream a completion from a running stack"),
    "embed": ("cli.embed", "print the embeddings of texts from a running stack"),
    "bench": ("cli.bench.command", "measure a workload against transformers' generate_batch and generate"),
    "bench-plot": ("cli.bench.plot", "plot tokens/s and inter-token latency from bench JSON files"),
    "monitor": ("cli.monitor", "live view of a figure (cache usage, queues) until Ctrl-C"),
    "stats": ("cli.stats", "print the cache service's block statistics"),
    "certs": ("cli.certs", "write a CA and the internal plane's mTLS certificates"),
}


def parser(command: str | None) -> argparse.ArgumentParser:
    """The CLI's parser: every command listed, only `command`'s flags declared (its module imported)."""
    top = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: a paged-KV LLM inference server"
    )
    commands = top.add_subparsers(dest="command", required=True)
    for name, (module, line) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(commands)
        else:
            commands.add_parser(name, help=line)
    return top


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = parser(command).parse_args(argv)
    raise SystemExit(args.run(args))


if __name__ == "__main__":
    main()
