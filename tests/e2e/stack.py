"""The whole stack (`pagedserve up`) as a real process tree, for end-to-end tests."""

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from cli.launch import Stack
from cli.scrape import scrape
from tests.helpers import ROOT

# The small stack (a session fixture shared by the modules that need blocks to run out): the real model in
# float32 behind 24 blocks of 16 tokens, 64-token steps, at most 12 sequences, debug JSON logs.
SMALL_KV_BLOCKS = 24
SMALL_BUDGET = 64
SMALL_FLAGS = (
    *("--dtype", "float32", "--kv-blocks", str(SMALL_KV_BLOCKS), "--max-batched-tokens", str(SMALL_BUDGET)),
    *("--max-seqs", "12", "--log-format", "json", "--log-level", "debug"),
    # NOTE: the scheduling tests' background streams are sized to outlast a prefill beside them at 8 decode
    # steps a call (more steps a call decode them faster).
    *("--decode-steps", "8"),
)


PREEMPTIONS = "pagedserve_preemptions_total"


def preemptions(stack: Stack) -> float:
    """Sequences the stack's gateway has preempted so far."""
    return scrape(stack.metrics_url("gateway"))[PREEMPTIONS, ()]


def start_stack(log_dir: Path, *args: str) -> Stack:
    """`pagedserve up` with these flags on free ports, its log in log_dir; waits until it serves. Without
    compute's standby unless the flags ask for it: these stacks' compute is never killed, and a standby's
    start (one compute start of CPU) would only slow the tests beside it; test_compute_standby.py and
    test_supervisor.py run `up` with it."""
    standby = () if any("compute-standby" in arg for arg in args) else ("--no-compute-standby",)
    return Stack.start(*args, *standby, log_dir=log_dir, cwd=ROOT, timeout=600)


@contextmanager
def stacks_side_by_side(
    log_dir: Path, flags: Sequence[str], option: str, values: Sequence[str]
) -> Iterator[dict]:
    """One stack per value of `option` (with `flags` besides), started side by side, by value; each must stop
    cleanly (exit status 0).
    NOTE: side by side: most of a start is imports and model loading, mostly waiting on disk."""
    started: dict[str, Stack] = {}
    try:
        with ThreadPoolExecutor(len(values)) as pool:
            futures = {value: pool.submit(start_stack, log_dir, *flags, option, value) for value in values}
            for value, future in futures.items():
                started[value] = future.result()
        yield started
    finally:
        codes = [stack.stop() for stack in started.values()]
    assert codes == [0] * len(values)
