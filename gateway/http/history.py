"""The dashboard's charts: a ring buffer of per-second samples of the engine's view (tokens/s, KV usage,
prefix-cache hit rate, preemptions), taken by a daemon thread of the gateway; no RPC."""

import threading
import time
from collections import deque
from collections.abc import Callable

from gateway.engine_view import EngineSnapshot, Totals

SAMPLE_INTERVAL_S = 1.0
# Ten minutes of samples.
HISTORY_SAMPLES = 600


class History:
    """The last `size` samples, one per `interval_s`, oldest first. A sample's rates cover the interval
    before it; hit_rate is None when no request got its first token in it."""

    def __init__(
        self,
        read: Callable[[], tuple[EngineSnapshot, Totals]],
        interval_s: float = SAMPLE_INTERVAL_S,
        size: int = HISTORY_SAMPLES,
    ) -> None:
        self.interval_s = interval_s
        self._read = read
        self._lock = threading.Lock()
        self._samples: deque[tuple] = deque(maxlen=size)
        self._last: tuple[float, EngineSnapshot, Totals] | None = None
        self._stop = threading.Event()

    def sample(self, now: float | None = None) -> None:
        """Appends the sample for the interval since the previous call (the first call only starts one)."""
        now = time.monotonic() if now is None else now
        snapshot, totals = self._read()
        if self._last is not None:
            then, before, was = self._last
            elapsed = max(now - then, 1e-9)
            prompt = totals.prompt_tokens - was.prompt_tokens
            sample = (
                time.time(),
                (totals.generated_tokens - was.generated_tokens) / elapsed,
                snapshot.kv_usage,
                (totals.cached_tokens - was.cached_tokens) / prompt if prompt else None,
                snapshot.preemptions - before.preemptions,
            )
            with self._lock:
                self._samples.append(sample)
        self._last = (now, snapshot, totals)

    def series(self) -> dict:
        """The samples as columns: t (unix seconds), tokens_per_s, kv_usage, hit_rate, preemptions."""
        with self._lock:
            samples = list(self._samples)
        names = ("t", "tokens_per_s", "kv_usage", "hit_rate", "preemptions")
        columns = {name: [sample[i] for sample in samples] for i, name in enumerate(names)}
        return {"interval_s": self.interval_s, **columns}

    def start(self) -> None:
        threading.Thread(target=self._run, name="dashboard-history", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.interval_s):
            self.sample()
