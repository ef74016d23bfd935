"""A real redis-server (Debian's, on PATH) for the Redis KV tier's tests: on 127.0.0.1 only, nothing saved
to disk, stopped and started again on the same port (the tier's outage and return)."""

import shutil
import subprocess
import time
from pathlib import Path

import redis

from cli.launch import free_port

# NOTE: the tier's records of the tests are small; this bounds a run-away test all the same.
MAXMEMORY = "64mb"


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        assert shutil.which("redis-server"), "no redis-server: run make tools"
        self.workdir, self.port = workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Starts the server on its port and waits until it answers PING (at most 10 s)."""
        assert self.proc is None, "already running"
        argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly",
                "no", "--dir", str(self.workdir), "--maxmemory", MAXMEMORY,
                "--maxmemory-policy", "allkeys-lru"]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with self.client() as client:
                    client.ping()
                return
            except redis.ConnectionError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        """Kills the server (its data is lost: nothing is saved)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)
