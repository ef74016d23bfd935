"""What other threads tell the engine loop: sequences to queue, requests to abort, peers lost, and the
stop. Each message wakes the loop and ends a running multi-step call after its current step
(`interrupt`), so that the loop hears it within a step."""

import threading
from collections.abc import Callable

from gateway.sequence import Sequence


class Inbox:
    """Written under `lock` (which also guards what the engine shares with the RPC threads), read by the
    engine thread in `take`."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.intake: list[Sequence] = []
        self.aborts: set[str] = set()
        # The peers lost (seen restarted by the health watcher), each with when it was last seen down.
        self.lost: dict[str, float] = {}
        self.stopped = False
        self.interrupt: Callable[[], None] = lambda: None

    def posted(self) -> None:
        """Under `lock`, once a message is in: the loop wakes; a running multi-step call ends after its
        step."""
        self.lock.notify()
        self.interrupt()

    def lose(self, service: str, seen_at: float) -> None:
        """Under `lock`: `service` restarted after `seen_at` (time.monotonic())."""
        self.lost[service] = max(seen_at, self.lost.get(service, seen_at))
        self.posted()

    def take(
        self, runnable: bool, timeout: float | None, attached_at: float
    ) -> tuple[list[Sequence], set[str], set[str]] | None:
        """Waits for a message, unless `runnable` (work is there), at most `timeout` seconds (None: no
        limit); takes them all: (intake, aborts, lost), or None once stopped. Lost are the peers seen down
        after `attached_at`, the last handshake's end: one it attached since was restarted before it."""
        with self.lock:
            while not (self.stopped or self.intake or self.aborts or runnable or self.lost):
                if not self.lock.wait(timeout) and timeout is not None:
                    break
            if self.stopped:
                return None
            lost = {service for service, seen_at in self.lost.items() if seen_at > attached_at}
            news = self.intake, self.aborts, lost
            self.intake, self.aborts, self.lost = [], set(), {}
            return news
