"""The compute address's lock, and the warm standby that waits on it (`pagedserve up`, docs/reliability.md).

A compute service listening on a unix socket (`--socket PATH`) holds an exclusive lock (flock) on PATH.lock
for its whole life; the kernel lets it go the moment the process ends, however it ends. A standby
(`--standby`) starts like any compute (imports, model loaded to its plan, kernels loaded) and then blocks on
that lock instead of binding: when the compute serving there dies, the standby gets the lock at once, binds
the socket and serves; the gateway's handshake attaches it to the cache's pool as it would a restarted
compute. Nothing polls: the takeover starts at the kill.

A standby loads and waits at a lower CPU priority (nice +STANDBY_NICE): its start (seconds of CPU) runs
once the stack serves, and again after each takeover, on the cores compute steps on, and must not slow the
compute serving. Taking over, it sets every thread back to the priority it started with.

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
THREADS = Path("/proc/self/task")
# How much lower the standby's priority is while it loads and waits: CPU time shares of about 1 to 10 against
# a thread of the serving compute's (the kernel's nice weights), so that a standby still loads on a machine
# busy with serving, in tens of seconds rather than never.
STANDBY_NICE = 10
# The priority this process started with, once `yield_cpu` lowered it.
_started_at: int | None = None


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


def yield_cpu() -> None:
    """Lowers this thread's priority by STANDBY_NICE; threads it starts later inherit it (torch's OpenMP
    workers, the server's)."""
    global _started_at
    _started_at = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, min(_started_at + STANDBY_NICE, 19))


def restore_cpu(log) -> None:
    """Every thread of this process back to the priority it started with; a process not allowed to raise its
    priority (no CAP_SYS_NICE, RLIMIT_NICE too low) keeps the lower one, and says so."""
    if _started_at is None:
        return
    for thread in THREADS.iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(thread.name), _started_at)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except PermissionError:
            log.warning(
                "standby_priority_kept",
                nice=os.getpriority(os.PRIO_PROCESS, 0),
                hint="this process may not raise its priority (CAP_SYS_NICE, or RLIMIT_NICE): the compute "
                "that took over serves at the standby's lower one; allow it, or use --no-compute-standby",
            )
            return


def stop_with_lifeline() -> None:
    """From now on the end of this process's lifeline (common/lifeline.py) is sent on as SIGTERM: before
    `Server.handle_signals` it ends the process (a standby still loading, or waiting), after it stops the
    server as the lifeline would."""
    # NOTE: imported here: cli.processes reads this module's names and must stay light (no structlog).
    from common import lifeline

    lifeline.watch(lambda: os.kill(os.getpid(), signal.SIGTERM))


def wait_to_take_over(socket: str, log) -> None:
    """Blocks until the socket's lock is free, then holds it for the life of this process, every thread back
    at the priority the process started with."""
    # NOTE: what start-up built is frozen now (common/server.py serve() does it too, then with nothing left).
    gc.collect()
    gc.freeze()
    fd = _open(socket)
    COMM.write_text(WAITING)
    log.info("standby_waiting", socket=socket, lock=lock_path(socket))
    fcntl.flock(fd, fcntl.LOCK_EX)
    COMM.write_text(SERVING)
    restore_cpu(log)
    log.info("standby_taking_over", socket=socket)


def take_address(socket: str | None, standby: bool, log) -> None:
    """Before compute binds `socket`: waits for it as a standby, or takes it at once (ValueError if held)."""
    if socket is None:
        return
    if standby:
        wait_to_take_over(socket, log)
    else:
        hold(socket)
