"""A service's lifeline from `pagedserve up` (cli/lifelines.py): the read end of a pipe whose write ends the
launcher and the services that call this one hold. It reads end-of-file once all of them have exited, and
the service then stops as on SIGTERM: so when the launcher dies, even by kill -9, the gateway drains first
while compute and cache still serve it, then compute stops, then the cache."""

import os
import threading
from collections.abc import Callable

import structlog

# "READ_FD:HELD_FD,HELD_FD": the lifeline, and the write ends of the lifelines of the services this one calls.
ENV = "PAGEDSERVE_LIFELINE"


def encode(read_fd: int, held: list[int]) -> str:
    return f"{read_fd}:{','.join(map(str, held))}"


def watch(on_end: Callable[[], None]) -> bool:
    """Calls on_end (once, from a thread of its own) when this process's lifeline ends; returns whether it
    has one (a service started by `pagedserve up`). The variable is taken out of the environment and the
    pipe ends are kept from this process's own children, so only the launcher's services hold them."""
    value = os.environ.pop(ENV, None)
    if not value:
        return False
    read, _, held = value.partition(":")
    fds = [int(read), *(int(fd) for fd in held.split(",") if fd)]
    for fd in fds:
        os.set_inheritable(fd, False)
    threading.Thread(target=_wait_for_end, args=(fds[0], on_end), name="lifeline", daemon=True).start()
    return True


def _wait_for_end(fd: int, on_end: Callable[[], None]) -> None:
    # NOTE: nothing is ever written: a read returns only at end-of-file, when the last write end closed.
    while os.read(fd, 1):
        pass
    structlog.get_logger().warning("lifeline_ended", action="stopping as on SIGTERM")
    on_end()
