"""What a test injects into a gateway's steps (docs/testing.md, Faults in a step): a StepHook, loaded by the
start-up flag --step-hook; gateway/step_runner.py is the one module that calls it."""

import importlib
from typing import Protocol

from gateway.sequence import Sequence
from protos import compute_pb2_grpc


class StepHook(Protocol):
    """A test's faults, loaded by --step-hook MODULE:NAME[=ARG] as NAME(ARG) (tests/step_hooks.py)."""

    def stage(self, name: str, seqs: list[Sequence]) -> None:
        """Called as stage `name` begins for `seqs`: "schedule" and "update" once per row, "reserve" and
        "run" once per call; raises as that stage's own code would."""

    def compute(self, stub: compute_pb2_grpc.ComputeStub) -> compute_pb2_grpc.ComputeStub:
        """The stub the steps are sent on (the given one, or a wrapper of it)."""


def load_hook(spec: str) -> StepHook:
    """MODULE:NAME[=ARG] → NAME(ARG), NAME imported from MODULE."""
    module, _, name = spec.partition(":")
    name, _, arg = name.partition("=")
    return getattr(importlib.import_module(module), name)(arg)
