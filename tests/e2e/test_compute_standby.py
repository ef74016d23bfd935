"""`pagedserve up`'s warm compute standby (compute_service/standby.py): once the stack serves, a second
compute loads the model and waits on compute's socket lock; a compute killed with SIGKILL is replaced by it
(no fresh process started), the gateway goes on from the KV the cache kept, the streams end with the
fault-free run's greedy tokens, and `up` starts the next standby. The tiny model starts fast."""

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cli.launch import Stack
from cli.processes import services_of, standby_of
from compute_service.standby import STANDBY_NICE
from tests.helpers import ROOT, log_events

pytestmark = pytest.mark.e2e
# The session's tiny model holds 512 positions.
STREAMS, NEW_TOKENS, KILL_AFTER = 4, 500, 5
# Bounds on waits only (a standby's start on a loaded machine), never asserted as timings.
LOAD_S = 300


def wait_until(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    return None


def loaded_standby(stack: Stack, other_than: int = 0) -> int | None:
    """The pid of the stack's standby (not `other_than`) once it is loaded and waits to take over."""
    found = standby_of(stack.proc.pid)
    return found[0] if found is not None and found[1] and found[0] != other_than else None


def priorities(pid: int) -> set[int]:
    """The nice values of process pid's threads."""
    found = set()
    for thread in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            found.add(os.getpriority(os.PRIO_PROCESS, int(thread.name)))
    return found


def listening_on(socket: Path, pid: int) -> bool:
    """Whether process pid holds the socket listening at path `socket`."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    # Num RefCount Protocol Flags Type St Inode Path; Flags 00010000: listening.
    inodes = {
        f"socket:[{f[6]}]" for f in map(str.split, lines) if f[-1] == str(socket) and f[3] == "00010000"
    }
    fds = Path(f"/proc/{pid}/fd")
    return any(os.readlink(fd) in inodes for fd in fds.iterdir())


def test_a_killed_compute_is_replaced_by_its_standby_and_the_streams_go_on(tiny_model, logs):
    stack = Stack.start("--model", str(tiny_model), "--dtype", "float32", "--kv-blocks", "1024",
                        "--log-format", "json", log_dir=logs, cwd=ROOT, timeout=300)  # fmt: skip
    requests = [dict(token_ids=[3 + i, 40, 50, 60], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
                for i in range(STREAMS)]  # fmt: skip
    received = [0] * STREAMS

    def run(i: int) -> list[int]:
        with stack.client() as client:
            tokens = []
            for chunk in client.stream(**requests[i]):
                tokens.extend(chunk.token_ids)
                received[i] = len(tokens)
            return tokens

    try:
        standby = wait_until(lambda: loaded_standby(stack), LOAD_S)
        assert standby, "up started a standby once the stack served, and it loaded"
        with stack.client() as client:
            expected = [client.generate(**request).token_ids for request in requests]
        compute = services_of(stack.proc.pid)["compute"]
        assert compute != standby
        serving = os.getpriority(os.PRIO_PROCESS, compute)
        assert priorities(standby) == {min(serving + STANDBY_NICE, 19)}, (
            "the standby yields the CPU, every thread"
        )
        with ThreadPoolExecutor(STREAMS) as pool:
            running = [pool.submit(run, i) for i in range(STREAMS)]
            assert wait_until(lambda: min(received) >= KILL_AFTER, 60), received
            os.kill(compute, signal.SIGKILL)
            at_kill = list(received)
            results = [future.result(300) for future in running]
        assert max(at_kill) < NEW_TOKENS, "compute was killed mid-stream"
        assert results == expected, "the streams went on with the fault-free run's greedy tokens"
        assert services_of(stack.proc.pid)["compute"] == standby
        socket = Path(stack.compute_target.removeprefix("unix:"))
        assert listening_on(socket, standby), "the standby serves compute's socket"
        assert priorities(standby) == {serving}, "taking over, every thread got compute's priority back"
        log = stack.proc.log_path.read_text()
        assert f"compute exited (signal SIGKILL); its standby (pid {standby}) takes over, restart 1" in log
        assert "compute restarted" not in log, "no fresh compute was started in its place"
        attached = [event for event in log_events(stack.proc.log_path) if event["event"] == "attached"]
        assert (attached[-1]["again"], attached[-1]["kept_running"]) == (True, STREAMS), "the KV was kept"
        took_over = [e for e in log_events(stack.proc.log_path) if e["event"] == "standby_taking_over"]
        assert len(took_over) == 1
        assert wait_until(lambda: loaded_standby(stack, other_than=standby), LOAD_S), "up started the next"
        with stack.client() as client:
            assert client.generate(**requests[0]).token_ids == expected[0], "the promoted compute serves"
    finally:
        assert stack.stop() == 0
