"""The smallest start of the gateway's HTTP front: uvicorn serving the app from a thread of the gateway
process, on a socket bound before it returns (so a taken port fails the start, not the thread)."""

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

STARTUP_TIMEOUT_S = 10.0


@dataclass
class HttpFront:
    server: uvicorn.Server
    thread: threading.Thread
    port: int

    def stop(self, timeout: float = 5.0) -> None:
        """Stops accepting, lets open requests finish (up to `timeout`), and returns."""
        self.server.should_exit = True
        self.thread.join(timeout)


def start_http(app: FastAPI, host: str, port: int, tls: tuple[Path, Path] | None = None) -> HttpFront:
    """Serves `app` on host:port (port 0: a free one), HTTPS with tls = (cert, key) PEM files; returns once
    it accepts. OSError if the port cannot be bound, RuntimeError if uvicorn does not start."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family)
    cert, key = tls if tls else (None, None)
    # NOTE: log_config=None leaves the gateway's logging as it is; no access log (a ?key= would be in it).
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", ssl_certfile=cert, ssl_keyfile=key
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"the HTTP server on {host}:{port} did not start (see the log above)")
        time.sleep(0.02)
    return HttpFront(server, thread, sock.getsockname()[1])
