"""The gateway's health follows its downstream services: SERVING only while cache and compute both are."""

import threading

import structlog

from common.healthcheck import serving
from common.server import Server

log = structlog.get_logger()
CHECK_INTERVAL_S = 1.0


class DownstreamWatcher:
    """Polls grpc.health.v1 on each downstream target and flips `service` on `server` when any changes."""

    def __init__(self, server: Server, service: str, targets: dict[str, str]) -> None:
        self._server = server
        self._service = service
        self._targets = targets
        self._stop = threading.Event()
        self.serving: bool | None = None

    def down(self) -> list[str]:
        """Names of the downstream services that do not answer SERVING within one interval."""
        return [
            name for name, target in self._targets.items() if not serving(target, timeout=CHECK_INTERVAL_S)
        ]

    def run(self) -> None:
        while True:
            down = self.down()
            serving = not down
            if serving != self.serving:
                self._server.set_serving(self._service, serving)
                (log.info if serving else log.warning)("health", serving=serving, down=down)
                self.serving = serving
            if self._stop.wait(CHECK_INTERVAL_S):
                return

    def start(self) -> None:
        threading.Thread(target=self.run, name="health-watcher", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
