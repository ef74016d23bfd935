"""The gateway's health tells whether it can serve: SERVING only while cache and compute both answer
SERVING and the engine steps on the pool the cache serves now (same epoch)."""

import threading
import time
from collections.abc import Callable

import grpc
import structlog

from common.healthcheck import SERVING, status
from common.server import Server, channel
from protos import cache_pb2, cache_pb2_grpc

log = structlog.get_logger()
CHECK_INTERVAL_S = 1.0


class DownstreamWatcher:
    """Polls grpc.health.v1 on each downstream target (and the cache's pool epoch, when `attached_epoch`
    is given) and flips `service` on `server` when the answer changes.

    A target named in `optional` (a prefill compute: the engine steps without it) is watched for restarts
    but not needed for SERVING.

    `on_restart(name, seen_at)` is called when a peer that could not be reached answers again, or when the
    cache serves another pool than the attached one: either restarted after `seen_at` (time.monotonic() of
    the check that saw it down or different), so the gateway must attach again unless it did since.
    """

    def __init__(
        self,
        server: Server,
        service: str,
        targets: dict[str, str],
        attached_epoch: Callable[[], str | None] | None = None,
        on_restart: Callable[[str, float], None] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        optional: frozenset[str] = frozenset(),
    ) -> None:
        self._server = server
        self._optional = optional
        self._service = service
        self._targets = targets
        self._attached_epoch = attached_epoch
        self._on_restart = on_restart or (lambda name, seen_at: None)
        self._credentials = credentials
        # The peers that could not be reached, and when they were last seen so.
        self._unreachable: dict[str, float] = {}
        self._stop = threading.Event()
        self.serving: bool | None = None

    def down(self) -> list[str]:
        """Names of the needed downstream services that do not answer SERVING within one interval (and notes
        which of them could not be reached: a peer that answers again after that has restarted)."""
        now = time.monotonic()
        answers = {
            name: status(target, timeout=CHECK_INTERVAL_S, credentials=self._credentials)
            for name, target in self._targets.items()
        }
        for name, answer in answers.items():
            if answer == grpc.StatusCode.UNAVAILABLE.name:
                self._unreachable[name] = now
            elif answer == SERVING and name in self._unreachable:
                self._on_restart(name, self._unreachable.pop(name))
        return [name for name, answer in answers.items() if answer != SERVING and name not in self._optional]

    def stale_pool(self) -> str | None:
        """Why the engine's pool is not the one the cache serves now, or None when it is."""
        if self._attached_epoch is None:
            return None
        # NOTE: taken before the attached epoch is read: an attach after it may be to the pool asked about.
        asked_at = time.monotonic()
        attached = self._attached_epoch()
        if attached is None:
            return "no pool attached"
        try:
            with channel(self._targets["cache"], self._credentials) as ch:
                stats = cache_pb2_grpc.CacheStub(ch).GetStats(
                    cache_pb2.GetStatsRequest(), timeout=CHECK_INTERVAL_S
                )
        except grpc.RpcError as err:
            return f"cache GetStats: {err.code().name}"
        if stats.pool_epoch != attached:
            self._on_restart("cache", asked_at)
            return f"the cache serves pool {stats.pool_epoch!r}, attached is {attached!r}"
        return None

    def check(self) -> None:
        down = self.down()
        stale = None if down else self.stale_pool()
        serving = not down and stale is None
        if serving != self.serving:
            self._server.set_serving(self._service, serving)
            (log.info if serving else log.warning)("health", serving=serving, down=down, pool=stale)
            self.serving = serving

    def run(self) -> None:
        while True:
            self.check()
            if self._stop.wait(CHECK_INTERVAL_S):
                return

    def start(self) -> None:
        threading.Thread(target=self.run, name="health-watcher", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
