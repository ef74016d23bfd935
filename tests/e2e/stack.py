"""The whole stack (`pagedserve up`) as a real process tree, for end-to-end tests."""

from pathlib import Path

from cli.launch import Stack
from tests.helpers import ROOT


def start_stack(log_dir: Path, *args: str) -> Stack:
    """`pagedserve up` with these flags on free ports, its log in log_dir; waits until it serves."""
    return Stack.start(*args, log_dir=log_dir, cwd=ROOT, timeout=600)
