"""Command-line flags declared once: each service's `python -m` entry point and `pagedserve up` build their
parsers from the same declarations.

A service's flags are of two kinds. Its placement (where it listens, whom it calls) `pagedserve up` decides
for each service itself. Its settings `up` takes as flags of its own, with the same type, default, choices
and help, and forwards them (`ServiceOptions.command_line`); a setting shared by several services (the
model, the log format) is one declaration here, added once.
"""

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from common.devices import CPU, device_arg
from common.model_files import DEFAULT_MODEL
from common.precision import DTYPE_CHOICES, KV_DTYPE_CHOICES

# Adds some flags to a parser (or an argument group).
Adder = Callable[[argparse.ArgumentParser], None]
# The exit status of a service that refuses its settings or its model at start-up, as argparse's for bad
# flags: `pagedserve up` stops then instead of restarting it (it would refuse again).
REFUSED = 2
LOG_LEVELS = ("debug", "info", "warning", "error")


def positive_seconds(text: str) -> float:
    """A flag's duration: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def add_address(parser: argparse.ArgumentParser, port: int) -> None:
    """Where a service listens: its gRPC address and its Prometheus endpoint."""
    parser.add_argument("--host", default="127.0.0.1", help="address the service and its /metrics bind")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")


def add_logging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format", choices=("console", "json"), default="console", help="structlog lines"
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="debug: one line per RPC too")


def add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="'smollm2' (SmolLM2-135M), a GGUF file or a HF model directory"
    )


def add_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="auto: float32 on the cpu, bfloat16 on a GPU or NPU",
    )


def add_kv_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-dtype",
        choices=KV_DTYPE_CHOICES,
        default="auto",
        help="dtype the KV pool stores (auto: the weights' dtype); fp8 ones use calibrated per-layer scales",
    )


def add_kv_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-device",
        type=device_arg,
        default=CPU,
        help="where the KV pool lives: cpu (a /dev/shm segment), cuda[:N] (CUDA IPC), npu[:N] (Ascend, the "
        "npu extra); the cache creates it there, compute runs the model there (default: cpu)",
    )


@dataclass(frozen=True)
class ServiceOptions:
    """A service's command line: `python -m module`, listening on `port` by default."""

    module: str
    port: int
    # What `pagedserve up` forwards, in the order they appear in --help.
    settings: tuple[Adder, ...]
    # Placement beyond the address (the gateway's downstream targets): `pagedserve up` decides it.
    wiring: tuple[Adder, ...] = ()

    def parser(self, description: str | None = None) -> argparse.ArgumentParser:
        """The service's own parser: its address, wiring and settings."""
        parser = argparse.ArgumentParser(prog=f"python -m {self.module}", description=description)
        add_address(parser, self.port)
        for add in (*self.wiring, *self.settings):
            add(parser)
        return parser

    def command_line(self, args: argparse.Namespace) -> list[str]:
        """The flags that make the service's parser read args' values of its settings (those at their
        default left out); args comes from a parser the settings were added to."""
        declared = argparse.ArgumentParser(add_help=False)
        for add in self.settings:
            add(declared)
        argv = []
        # NOTE: argparse has no public list of a parser's actions; _actions is the one it keeps.
        for action in declared._actions:
            value, flag = getattr(args, action.dest), action.option_strings[0]
            assert action.nargs in (None, 0, "+"), f"{flag}: only switches and value flags are forwarded"
            if value == action.default:
                continue
            if action.nargs == "+":
                argv += [flag, *map(str, value)]
            else:
                argv += [flag] if action.nargs == 0 else [flag, str(value)]
        return argv
