"""The limits on constraints and tools, declared once (each a field with its default and flag), checked by
gateway.structured.spec, gateway.structured.grammars and gateway.tools.request; a refusal is
INVALID_ARGUMENT naming the limit, the value and the flag."""

import argparse
from dataclasses import dataclass, fields

from gateway.limits import count, limit


@dataclass(frozen=True)
class ConstraintLimits:
    max_constraint_bytes: int = limit(
        64 * 2**10,
        "bytes of a constraint (schema, regex, grammar, choices) or of all tools' parameter schemas",
    )
    max_constraint_depth: int = limit(32, "nesting depth of a JSON schema's objects and arrays")
    max_constraint_compile_ms: int = limit(
        2000, "milliseconds a constraint may take to compile (compiled ones are cached by content)"
    )
    max_tools: int = limit(128, "entries of tools")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ConstraintLimits":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def add_constraint_limits(parser: argparse.ArgumentParser) -> None:
    for f in fields(ConstraintLimits):
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=count, default=f.default, help=f.metadata["help"]
        )
