"""A gateway as a real process for tests, on a cache and compute started apart: started (again on its port
after it was killed) and waited for until it serves."""

from pathlib import Path

from cli.launch import GATEWAY_SERVICE
from sdk import Client
from tests.e2e.cache_process import Service
from tests.helpers import free_port, start, stop, wait_healthy


class Gateway:
    def __init__(self, tmp: Path, name: str, cache: Service, compute_target: str, *flags: str) -> None:
        self.tmp, self.name, self.starts = tmp, name, 0
        self.target = f"127.0.0.1:{free_port()}"
        self._argv = ["--port", self.target.rsplit(":", 1)[1], "--cache-target", cache.target,
                      "--compute-target", compute_target, *flags]  # fmt: skip
        self.start()

    def start(self, *flags: str) -> None:
        """Starts it (again, on its port, with these flags besides its own) and waits until it serves."""
        log_path = (
            self.tmp / f"{self.name}-{self.starts}.log" if self.starts else self.tmp / f"{self.name}.log"
        )
        self.starts += 1
        self.proc = start("gateway", *self._argv, *flags, log_path=log_path)
        try:
            wait_healthy(self.target, self.proc, timeout=300, service=GATEWAY_SERVICE)
        except BaseException:
            stop(self.proc)
            raise

    def client(self) -> Client:
        return Client(self.target, timeout=120)
