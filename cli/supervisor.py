"""The services of `pagedserve up` as child processes: each stops in order when the launcher dies, one that
exits unexpectedly is restarted with backoff (or replaced by its warm standby, which takes its place by
itself: compute_service/standby.py), and the stack stops in a given order."""

import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cli.lifelines import Lifelines
from common import lifeline
from common.options import REFUSED

STOP_TIMEOUT_S = 30.0


def spawn(argv: list[str], fds: tuple[int, ...], line: str) -> subprocess.Popen:
    """Starts argv in a session of its own (Ctrl-C reaches only the launcher), inheriting `fds` and told
    its lifeline (common/lifeline.py) by the environment."""
    env = {**os.environ, lifeline.ENV: line}
    return subprocess.Popen(argv, start_new_session=True, pass_fds=fds, env=env)


@dataclass(frozen=True)
class RestartPolicy:
    """Restart after first_delay_s, doubled for each earlier exit within window_s, at most max_delay_s;
    give up when a service exits more than max_restarts times within window_s."""

    max_restarts: int = 5
    window_s: float = 60.0
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0


class Restarts:
    """One service's exits under a policy, on a monotonic clock."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.count = 0
        self._exits: deque[float] = deque()

    def delay(self) -> float | None:
        """Records an exit now; returns the seconds to wait before restarting, or None: give up."""
        now = self.clock()
        while self._exits and now - self._exits[0] > self.policy.window_s:
            self._exits.popleft()
        if len(self._exits) >= self.policy.max_restarts:
            return None
        delay = min(self.policy.first_delay_s * 2 ** len(self._exits), self.policy.max_delay_s)
        self._exits.append(now)
        self.count += 1
        return delay


@dataclass
class Service:
    name: str
    argv: list[str]
    restarts: Restarts
    proc: subprocess.Popen | None = None
    # When the service is due to start again after it exited; None while it runs.
    restart_at: float | None = field(default=None)


@dataclass
class Standby:
    """A second process of a service, started once armed and kept running, that takes the service's place
    when it exits; its own exits are restarted with backoff under the same policy."""

    argv: list[str]
    restarts: Restarts
    proc: subprocess.Popen | None = None
    # When the next standby is due to start; None while one runs, or before `arm_standbys`.
    start_at: float | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def describe_exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class Supervisor:
    """Starts services in order, restarts those that exit (`check`) unless they refused their settings (exit
    status REFUSED), stops them in reverse order (`stop`).

    `on_exit(name, pid)` runs once for every exited process, expected or not (e.g. to remove what it left).
    `standbys` are the command lines of the services' standbys (see Standby), started once `arm_standbys`
    was called: a service that exits while its standby runs is the standby from then on (counted as a
    restart), and the next standby starts after the restart delay.
    """

    def __init__(
        self,
        commands: dict[str, list[str]],
        policy: RestartPolicy,
        on_exit: Callable[[str, int], None] = lambda name, pid: None,
        clock: Callable[[], float] = time.monotonic,
        standbys: dict[str, list[str]] | None = None,
    ) -> None:
        self.services = {
            name: Service(name, argv, Restarts(policy, clock)) for name, argv in commands.items()
        }
        self.standbys = {
            name: Standby(argv, Restarts(policy, clock)) for name, argv in (standbys or {}).items()
        }
        self.on_exit = on_exit
        self.clock = clock
        self._lifelines = Lifelines(list(commands))

    def start(self) -> None:
        for service in self.services.values():
            service.proc = self._spawn(service)

    def _spawn(self, service: Service) -> subprocess.Popen:
        return spawn(service.argv, *self._lifelines.of(service.name))

    def arm_standbys(self) -> None:
        """Standbys start from now on (`check` starts them): `up` calls it once the stack serves, so that
        they do not slow its start."""
        for standby in self.standbys.values():
            if standby.proc is None and standby.start_at is None:
                standby.start_at = self.clock()

    def pids(self) -> dict[str, int]:
        """The pid of each running service."""
        return {name: s.proc.pid for name, s in self.services.items() if s.restart_at is None and s.proc}

    def check(self) -> str | None:
        """Restarts the services that exited once their delay passed; returns the name of one that exited
        more often than the policy allows (the caller stops the stack), else None."""
        for service in self.services.values():
            exited = service.restart_at is None and service.proc.poll() is not None
            if exited and not self._schedule_restart(service):
                return service.name
            if service.restart_at is not None and self.clock() >= service.restart_at:
                service.restart_at = None
                service.proc = self._spawn(service)
                print(f"pagedserve: {service.name} restarted (pid {service.proc.pid})", file=sys.stderr)
            if service.name in self.standbys:
                self._check_standby(service, self.standbys[service.name])
        return None

    def _schedule_restart(self, service: Service) -> bool:
        self.on_exit(service.name, service.proc.pid)
        how = describe_exit(service.proc.returncode)
        if service.proc.returncode == REFUSED:
            print(f"pagedserve: {service.name} refused its settings or model ({how}); stopping the stack",
                  file=sys.stderr)  # fmt: skip
            return False
        delay = service.restarts.delay()
        if delay is None:
            policy = service.restarts.policy
            print(f"pagedserve: {service.name} exited ({how}) more than {policy.max_restarts} times within "
                  f"{policy.window_s:g}s; stopping the stack", file=sys.stderr)  # fmt: skip
            return False
        standby = self.standbys.get(service.name)
        if standby is not None and standby.alive():
            service.proc, standby.proc = standby.proc, None
            standby.start_at = self.clock() + delay
            print(f"pagedserve: {service.name} exited ({how}); its standby (pid {service.proc.pid}) takes "
                  f"over, restart {service.restarts.count}; a new standby in {delay:g}s",
                  file=sys.stderr)  # fmt: skip
            return True
        print(f"pagedserve: {service.name} exited ({how}); restart {service.restarts.count} in {delay:g}s",
              file=sys.stderr)  # fmt: skip
        service.restart_at = self.clock() + delay
        return True

    def _check_standby(self, service: Service, standby: Standby) -> None:
        """Restarts a standby that exited (with backoff; none more past the policy's limit) and starts the
        one due, once its service runs."""
        if standby.proc is not None and standby.proc.poll() is not None:
            self.on_exit(service.name, standby.proc.pid)
            how, delay = describe_exit(standby.proc.returncode), standby.restarts.delay()
            standby.proc = None
            standby.start_at = None if delay is None else self.clock() + delay
            then = "no standby from now on" if delay is None else f"a new one in {delay:g}s"
            print(f"pagedserve: {service.name}'s standby exited ({how}); {then}", file=sys.stderr)
        due = standby.start_at is not None and self.clock() >= standby.start_at
        if due and service.restart_at is None:
            standby.start_at = None
            standby.proc = spawn(standby.argv, *self._lifelines.of(service.name))
            print(f"pagedserve: {service.name} standby started (pid {standby.proc.pid})", file=sys.stderr)

    def stop(self, timeouts: dict[str, float]) -> None:
        """SIGTERM each running service in reverse start order and waits for it (its timeout, else
        STOP_TIMEOUT_S) before the next; SIGKILL when it does not exit in time. (The order the lifelines
        keep when the launcher dies instead.)"""
        for service in reversed(self.services.values()):
            standby = self.standbys.get(service.name)
            # NOTE: a standby first: it would take the place of the service stopped before it.
            for proc in (standby.proc if standby else None, service.proc):
                if proc is None or (proc is service.proc and service.restart_at is not None):
                    continue
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeouts.get(service.name, STOP_TIMEOUT_S))
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                self.on_exit(service.name, proc.pid)
        self._lifelines.close()
