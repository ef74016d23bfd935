"""The compute address's lock, and the warm standby that waits on it (`pagedserve up`, docs/reliability.md).

A compute service listening on a unix socket (`--socket PATH`) holds an exclusive lock (flock) on PATH.lock
for its whole life; the kernel lets it go the moment the process ends, however it ends. A standby
(`--standby`) starts like any compute (imports, model loaded to its plan, kernels loaded) and then blocks on
that lock instead of binding: when the compute serving there dies, the standby gets the lock at once, binds
the socket and serves; the gateway's handshake attaches it to the cache's pool as it would a restarted
compute. Nothing polls: the takeover starts at the kill.

Whoever looks at the processes (`cli.processes`) tells a standby from the compute by its name
(/proc/PID/comm): WAITING while it waits on the lock, SERVING once it took it.
"""

import fcntl
import gc
import os
import signal
from pathlib import Path

# /proc/PID/comm of a standby: loaded and waiting for the lock; holding it (the compute serving).
WAITING, SERVING = "compute-standby", "compute"
FLAG = "--standby"
COMM = Path("/proc/self/comm")


def lock_path(socket: str) -> str:
    return f"{socket}.lock"


def _open(socket: str) -> int:
    # NOTE: the descriptor stays open (and the lock held) until the process ends; it is not inherited.
    return os.open(lock_path(socket), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def hold(socket: str) -> None:
    """Takes the socket's lock for the life of this process; ValueError when another process holds it."""
    fd = _open(socket)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(
            f"another compute service serves on {socket} (it holds {lock_path(socket)}): stop it, or start "
            f"this one with {FLAG} to take over when it exits"
        ) from None


def stop_with_lifeline() -> None:
    """From now on the end of this process's lifeline (common/lifeline.py) is sent on as SIGTERM: before
    `Server.handle_signals` it ends the process (a standby still loading, or waiting), after it stops the
    server as the lifeline would."""
    # NOTE: imported here: cli.processes reads this module's names and must stay light (no structlog).
    from common import lifeline

    lifeline.watch(lambda: os.kill(os.getpid(), signal.SIGTERM))


def wait_to_take_over(socket: str, log) -> None:
    """Blocks until the socket's lock is free, then holds it for the life of this process."""
    # NOTE: what start-up built is frozen now (common/server.py serve() does it too, then with nothing left).
    gc.collect()
    gc.freeze()
    fd = _open(socket)
    COMM.write_text(WAITING)
    log.info("standby_waiting", socket=socket, lock=lock_path(socket))
    fcntl.flock(fd, fcntl.LOCK_EX)
    COMM.write_text(SERVING)
    log.info("standby_taking_over", socket=socket)


def take_address(socket: str | None, standby: bool, log) -> None:
    """Before compute binds `socket`: waits for it as a standby, or takes it at once (ValueError if held)."""
    if socket is None:
        return
    if standby:
        wait_to_take_over(socket, log)
    else:
        hold(socket)
