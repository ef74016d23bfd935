"""The whole stack (`pagedserve up`) as a real process tree, for end-to-end tests."""

from pathlib import Path

from cli.launch import Stack
from tests.helpers import ROOT

# The small stack (a session fixture shared by the modules that need blocks to run out): the real model in
# float32 behind 24 blocks of 16 tokens, 64-token steps, at most 12 sequences, debug JSON logs.
SMALL_KV_BLOCKS = 24
SMALL_BUDGET = 64
SMALL_FLAGS = (
    *("--dtype", "float32", "--kv-blocks", str(SMALL_KV_BLOCKS), "--max-batched-tokens", str(SMALL_BUDGET)),
    *("--max-seqs", "12", "--log-format", "json", "--log-level", "debug"),
)


def start_stack(log_dir: Path, *args: str) -> Stack:
    """`pagedserve up` with these flags on free ports, its log in log_dir; waits until it serves."""
    return Stack.start(*args, log_dir=log_dir, cwd=ROOT, timeout=600)
