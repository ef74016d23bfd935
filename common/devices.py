"""Where the KV pool (and the model computing on it) lives: `cpu`, `cuda[:N]` or `npu[:N]`, as flags name
it. Each accelerator's IPC is common/device_ipc.py's.

NOTE: no torch here: the flags of `pagedserve up` name devices, and its launcher imports no torch."""

import argparse
from dataclasses import dataclass

from common.errors import InvalidArgument

DEVICE_TYPES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class Device:
    type: str
    index: int = 0

    def __post_init__(self) -> None:
        assert self.type in DEVICE_TYPES and self.index >= 0, self

    def __str__(self) -> str:
        return "cpu" if self.type == "cpu" else f"{self.type}:{self.index}"

    @property
    def torch(self) -> str:
        """The name torch places tensors by."""
        return str(self)


CPU = Device("cpu")


def parse_device(text: str) -> Device:
    """`cpu`, `cuda`, `cuda:N`, `npu`, `npu:N` (no index: 0); InvalidArgument otherwise."""
    kind, _, index = text.partition(":")
    if kind not in DEVICE_TYPES or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise InvalidArgument(f"device {text!r}: choose cpu, cuda[:N] or npu[:N]")
    return Device(kind, int(index or 0))


def device_arg(text: str) -> Device:
    """`parse_device` for argparse."""
    try:
        return parse_device(text)
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(str(err)) from err
