"""`pagedserve up`'s supervisor: the restart policy on a fake clock, and real child processes."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from cli.processes import gone
from cli.supervisor import RestartPolicy, Restarts, Supervisor, describe_exit
from common.options import REFUSED

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
FAILING = [sys.executable, "-c", "raise SystemExit(3)"]
ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_the_delay_doubles_with_each_exit_up_to_the_cap():
    clock = Clock()
    restarts = Restarts(RestartPolicy(max_restarts=10, window_s=60, first_delay_s=0.5, max_delay_s=3), clock)
    delays = []
    for _ in range(5):
        delays.append(restarts.delay())
        clock.now += 1
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert restarts.count == 5


def test_exits_older_than_the_window_are_forgotten():
    clock = Clock()
    restarts = Restarts(RestartPolicy(max_restarts=2, window_s=60), clock)
    assert restarts.delay() == 0.5
    clock.now += 30
    assert restarts.delay() == 1.0
    clock.now += 31
    assert restarts.delay() == 1.0, "the first exit left the window: one earlier exit counts"
    clock.now += 61
    assert restarts.delay() == 0.5


def test_more_exits_than_max_restarts_within_the_window_give_up():
    clock = Clock()
    restarts = Restarts(RestartPolicy(max_restarts=3, window_s=60), clock)
    assert [restarts.delay() for _ in range(3)] == [0.5, 1.0, 2.0]
    clock.now += 59
    assert restarts.delay() is None
    assert restarts.count == 3


def test_describe_exit_names_the_signal_or_the_code():
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(3) == "exit code 3"


def test_a_killed_service_is_restarted_and_reported(capsys):
    exits = []
    supervisor = Supervisor(
        {"a": SLEEPER, "b": SLEEPER},
        RestartPolicy(first_delay_s=0.0),
        on_exit=lambda name, pid: exits.append((name, pid)),
    )
    supervisor.start()
    try:
        first = supervisor.pids()
        os.kill(first["a"], signal.SIGKILL)
        assert wait_until(
            lambda: supervisor.check() is None and supervisor.pids().get("a") not in (None, first["a"])
        )
        assert supervisor.pids()["b"] == first["b"], "the others keep running"
        assert exits == [("a", first["a"])]
        assert "a exited (signal SIGKILL); restart 1 in 0s" in capsys.readouterr().err
    finally:
        supervisor.stop({})
    assert all(gone(pid) for pid in supervisor.pids().values())


def test_a_service_that_keeps_exiting_stops_the_stack(capsys):
    supervisor = Supervisor({"a": FAILING}, RestartPolicy(max_restarts=2, first_delay_s=0.0))
    supervisor.start()
    try:
        failed = []
        assert wait_until(lambda: failed.append(supervisor.check()) or failed[-1] is not None)
        assert failed[-1] == "a"
        assert supervisor.services["a"].restarts.count == 2
        assert "a exited (exit code 3) more than 2 times within 60s" in capsys.readouterr().err
    finally:
        supervisor.stop({})


def test_a_service_that_refuses_its_settings_stops_the_stack_without_a_restart(capsys):
    refusing = [sys.executable, "-c", f"raise SystemExit({REFUSED})"]
    supervisor = Supervisor({"a": refusing}, RestartPolicy(first_delay_s=0.0))
    supervisor.start()
    try:
        failed = []
        assert wait_until(lambda: failed.append(supervisor.check()) or failed[-1] is not None)
        assert failed[-1] == "a" and supervisor.services["a"].restarts.count == 0
        assert "a refused its settings or model (exit code 2); stopping the stack" in capsys.readouterr().err
    finally:
        supervisor.stop({})


def test_stop_runs_in_reverse_order_and_reports_each_exit():
    exits = []
    supervisor = Supervisor(
        {"a": SLEEPER, "b": SLEEPER}, RestartPolicy(), on_exit=lambda n, p: exits.append(n)
    )
    supervisor.start()
    pids = supervisor.pids()
    supervisor.stop({"b": 5})
    assert exits == ["b", "a"]
    assert all(gone(pid) for pid in pids.values())


# A service as the lifeline sees it: on its end it waits `delay` seconds (a drain), notes when it exits.
SERVICE = textwrap.dedent(
    """
    import sys, threading, time
    from common import lifeline
    ended = threading.Event()
    assert lifeline.watch(ended.set)
    ended.wait()
    time.sleep(float(sys.argv[2]))
    with open(sys.argv[1], "a") as out:
        print(sys.argv[3], time.monotonic(), file=out)
    """
)
LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from cli.supervisor import RestartPolicy, Supervisor
    service = lambda name, delay: [sys.executable, "-c", sys.argv[1], sys.argv[2], str(delay), name]
    commands = {name: service(name, delay) for name, delay in (("cache", 0), ("compute", 0), ("gateway", 1))}
    supervisor = Supervisor(commands, RestartPolicy())
    supervisor.start()
    print(*supervisor.pids().values(), flush=True)
    time.sleep(60)
    """
)


def test_a_killed_launchers_services_stop_in_order_the_last_started_first(tmp_path):
    """The gateway drains for a second after the launcher's kill -9; compute and cache wait for it."""
    exits = tmp_path / "exits"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, SERVICE, str(exits)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    pids = []
    try:
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(pids) == 3 and not any(gone(pid) for pid in pids)
        time.sleep(0.5)
        assert not exits.exists(), "no service stops while the launcher lives"
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        assert wait_until(lambda: all(gone(pid) for pid in pids), timeout=10)
        order = [line.split() for line in exits.read_text().splitlines()]
        assert [name for name, _ in order] == ["gateway", "compute", "cache"]
        assert float(order[0][1]) - killed >= 0.9, "compute and cache outlived the gateway's drain"
    finally:
        launcher.kill()
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_standby_starts_once_armed_takes_the_place_of_its_service_and_is_replaced(capsys):
    exits = []
    supervisor = Supervisor(
        {"a": SLEEPER, "b": SLEEPER},
        RestartPolicy(first_delay_s=0.0),
        on_exit=lambda name, pid: exits.append((name, pid)),
        standbys={"b": SLEEPER},
    )
    supervisor.start()
    try:
        supervisor.check()
        assert supervisor.standbys["b"].proc is None, "no standby before the stack is armed"
        supervisor.arm_standbys()
        supervisor.check()
        standby = supervisor.standbys["b"].proc.pid
        first = supervisor.pids()
        assert standby not in first.values()
        os.kill(first["b"], signal.SIGKILL)
        assert wait_until(lambda: supervisor.check() is None and supervisor.pids()["b"] == standby)
        assert wait_until(lambda: supervisor.check() is None and supervisor.standbys["b"].alive())
        assert supervisor.standbys["b"].proc.pid not in (standby, first["b"]), "a new standby"
        assert exits == [("b", first["b"])] and supervisor.services["b"].restarts.count == 1
        err = capsys.readouterr().err
        assert f"b exited (signal SIGKILL); its standby (pid {standby}) takes over, restart 1" in err
        assert "b restarted" not in err, "no fresh process was started in its place"
    finally:
        supervisor.stop({})
    assert [name for name, _ in exits] == ["b", "b", "b", "a"], "the standby stopped before its service"


def test_a_standby_that_exits_is_started_again_and_the_service_restarts_without_one(capsys):
    supervisor = Supervisor({"a": SLEEPER}, RestartPolicy(first_delay_s=0.0), standbys={"a": FAILING})
    supervisor.start()
    try:
        supervisor.arm_standbys()
        first = supervisor.pids()["a"]
        assert wait_until(lambda: supervisor.check() is None and supervisor.standbys["a"].restarts.count == 2)
        assert "a's standby exited (exit code 3); a new one in 0s" in capsys.readouterr().err
        supervisor.standbys["a"].start_at = None  # no standby runs when the service exits
        wait_until(lambda: supervisor.check() is None and not supervisor.standbys["a"].alive())
        os.kill(first, signal.SIGKILL)
        assert wait_until(
            lambda: supervisor.check() is None and supervisor.pids().get("a") not in (None, first)
        )
        assert "a exited (signal SIGKILL); restart 1 in 0s" in capsys.readouterr().err
    finally:
        supervisor.stop({})
