"""The KV event publisher (`--kv-events-endpoint`): a thread that sends the recorder's events as one
KVEventBatch per wake-up on a ZMQ PUB socket, numbered from 0, keeps the last batches for replay on a ROUTER
socket (`--kv-events-replay-endpoint`), and flushes what is left when the service stops.

Endpoints follow vLLM's rule: one with `*` or `::`, or an ipc:// or inproc:// one, is bound (subscribers
connect to each replica); any other tcp:// one is connected to (a subscriber that binds, such as a central
indexer). The replay endpoint is always bound; a subscriber sends it [b"", start] (start: 8 bytes,
big-endian) from a DEALER and gets [b"", topic, sequence, batch] for every kept batch from start on, then
[b"", b"", -1, b""].
"""

import itertools
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import msgspec
import structlog
import zmq

from cache_service.kv_events import wire
from cache_service.kv_events.options import REPLAY_BATCHES, EventsConfig, events_config
from cache_service.kv_events.recorder import EventRecorder

if TYPE_CHECKING:
    import argparse

    from cache_service.block_manager import BlockManager

# vLLM's default: messages the PUB socket queues per subscriber before it drops them.
HIGH_WATER_MARK = 100_000
# How long a stopping service waits for its last batches to leave.
LINGER_MS = 1000
# How often the thread looks for replay requests while no event comes.
POLL_S = 0.05
# NOTE: the thread waits this long after the first event before it takes them, so that the events of one
# RPC (a Reserve indexes and evicts several blocks) mostly go in one batch.
BATCH_WINDOW_S = 0.005

log = structlog.get_logger()


def binds(endpoint: str) -> bool:
    """Whether the endpoint is bound (else connected to), by vLLM's rule."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """Opens its sockets at construction (zmq.ZMQError if an endpoint cannot be bound or is malformed); the
    thread is the only user of the sockets afterwards."""

    def __init__(self, config: EventsConfig) -> None:
        self._topic = config.topic.encode()
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(HIGH_WATER_MARK)
        self._pub.setsockopt(zmq.LINGER, LINGER_MS)
        self._replay: zmq.Socket | None = None
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.recorder = EventRecorder(block_size=0)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._numbers = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._attached = False
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def attach(self, blocks: "BlockManager") -> None:
        """Publishes the new pool's prefix index: AllBlocksCleared first (nothing announced before holds)."""
        self.recorder.block_size = blocks.block_size
        blocks.block_pool.prefix.listeners.append(self.recorder)
        self._attached = True
        self.recorder.cleared()

    def close(self) -> None:
        """AllBlocksCleared if a pool was published, every batch sent, the sockets closed."""
        if self._attached:
            self.recorder.cleared()
        self._stop.set()
        self.recorder.wake.set()
        self._thread.join(LINGER_MS / 1000 + 5)

    def _run(self) -> None:
        while True:
            woken = self.recorder.wake.wait(POLL_S)
            stopping = self._stop.is_set()
            if woken:
                if not stopping:
                    time.sleep(BATCH_WINDOW_S)
                self.recorder.wake.clear()
                self._send(self.recorder.take())
            self._serve_replays()
            if stopping:
                break
        self._close_sockets()

    def _send(self, events: list[wire.Event]) -> None:
        if not events:
            return
        payload = self._encoder.encode(wire.KVEventBatch(time.time(), events, 0))
        number = next(self._numbers)
        try:
            self._pub.send_multipart([self._topic, wire.sequence_number(number), payload])
        except zmq.ZMQError as err:
            log.warning("kv_events_send_failed", sequence=number, error=str(err))
        self._kept.append((number, payload))

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv_events_bad_replay_request", frames=len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for number, payload in self._kept:
                if number >= start:
                    frames = [identity, b"", self._topic, wire.sequence_number(number), payload]
                    self._replay.send_multipart(frames)
            self._replay.send_multipart([identity, b"", b"", wire.END_OF_REPLAY, b""])

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()


def from_args(args: "argparse.Namespace", log) -> EventPublisher | None:
    """The publisher the flags ask for (None: events off); exits with one line if an endpoint cannot open."""
    config = events_config(args)
    if config is None:
        return None
    try:
        publisher = EventPublisher(config)
    except zmq.ZMQError as err:
        raise SystemExit(f"cache_service: --kv-events-endpoint {config.endpoint}: {err}") from err
    log.info("kv_events", endpoint=config.endpoint, topic=config.topic, replay=config.replay_endpoint)
    return publisher
