"""uvicorn serving the gateway's HTTP app in a thread of the gateway process, beside the gRPC server:
the port is bound at start-up (a port in use ends the gateway at once, with the reason), TLS with the
gateway's certificate when it has one, and a graceful stop after the gateway's drain."""

import socket
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI

# Seconds the stop waits for open connections (the drain has already ended every generation).
STOP_GRACE_S = 5.0
START_TIMEOUT_S = 30.0


class HttpServer:
    """A listening socket, then (`start`) the app served on it until `stop`."""

    def __init__(self, host: str, port: int, tls_cert: Path | None, tls_key: Path | None) -> None:
        assert port > 0, port
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self.socket = socket.create_server((host, port), family=family)
        self.port = self.socket.getsockname()[1]
        self.tls = tls_cert is not None
        self._tls_files = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key} if self.tls else {}
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, app: FastAPI) -> None:
        """Serves app; returns once uvicorn accepts connections (RuntimeError if it could not start)."""
        config = uvicorn.Config(
            app,
            http="h11",
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=STOP_GRACE_S,
            **self._tls_files,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self.socket]}, name="http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._server.started:
            raise RuntimeError("the HTTP server did not start (see the lines above)")

    def stop(self) -> None:
        """Stops accepting, lets open responses end (STOP_GRACE_S at most), closes the socket."""
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(STOP_GRACE_S + 5)
        self.socket.close()
