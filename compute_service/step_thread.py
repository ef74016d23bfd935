"""The one thread on which compute runs torch: loading the model, attaching a pool and every step.

NOTE: torch's CPU kernels (and the native ones, through at::parallel_for) run their parallel loops on
OpenMP, whose GNU runtime keeps one team of worker threads per thread that ever started a parallel loop,
for as long as that thread lives. gRPC serves each call on one of up to 64 pool threads, so steps run from
the handlers left a team behind each handler thread, and once the runtime manages more threads than the
machine has CPUs it stops letting idle workers spin: every parallel loop then waits for its workers to be
woken from a futex sleep, which costs every loop tens of microseconds. With steps on this one thread
there is one team, whose workers spin between loops as in a single-threaded program (measured in
docs/internals/cpu-fast-path.md, "One thread runs every step").
"""

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class StepThread:
    """Runs callables one at a time on one long-lived thread, in the caller's context variables."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute-steps")

    def submit(self, fn: Callable[..., T], *args) -> Future[T]:
        """`fn(*args)` queued behind what runs now; the future holds its result or exception."""
        return self._executor.submit(contextvars.copy_context().run, fn, *args)

    def call(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the thread; returns its result or raises its exception here."""
        return self.submit(fn, *args).result()
