"""The cache service's KV events as an indexer reads them: a real ZMQ SUB socket (and a DEALER for replays),
each batch decoded as plain msgpack (no pagedserve type involved), and the index of blocks they describe."""

import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq

# The keys of vLLM 0.32's events, as its msgspec structs encode them (fields at their None default left out).
STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "group_idx"}  # fmt: skip
REMOVED_KEYS = {"type", "block_hashes", "medium", "group_idx"}


@dataclass(frozen=True)
class Message:
    topic: bytes
    seq: int
    batch: list  # [ts, events, data_parallel_rank]


def message(frames: list[bytes]) -> Message:
    """A published message's three frames: topic, 8-byte big-endian sequence number, msgpack batch."""
    assert len(frames) == 3 and len(frames[1]) == 8, frames
    return Message(frames[0], int.from_bytes(frames[1], "big"), msgspec.msgpack.decode(frames[2]))


class Subscriber:
    """Receives every message of `endpoint` on a thread (`bind`: the subscriber binds, the publisher
    connects, as a central indexer runs)."""

    def __init__(self, endpoint: str, topic: bytes = b"", bind: bool = False) -> None:
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic)
        self._socket.setsockopt(zmq.LINGER, 0)
        (self._socket.bind if bind else self._socket.connect)(endpoint)
        self._lock = threading.Lock()
        self._received: list[Message] = []
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                received = message(self._socket.recv_multipart())
                with self._lock:
                    self._received.append(received)
                    self._last = time.monotonic()
        self._socket.close()

    def messages(self) -> list[Message]:
        with self._lock:
            return list(self._received)

    def wait_quiet(self, quiet_s: float = 1.0, timeout: float = 30.0) -> None:
        """Returns once no message came for quiet_s (TimeoutError after timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() - self._last < quiet_s:
            assert time.monotonic() < deadline, "the events never stopped coming"
            time.sleep(0.1)

    def wait_for(self, count: int, timeout: float = 30.0) -> list[Message]:
        """The messages once there are at least `count` (AssertionError after timeout)."""
        deadline = time.monotonic() + timeout
        while len(received := self.messages()) < count:
            assert time.monotonic() < deadline, f"{len(received)} messages, not {count}"
            time.sleep(0.05)
        return received

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def replay(endpoint: str, start: int = 0, timeout_ms: int = 10_000) -> list[Message]:
    """The batches the publisher kept from sequence number `start` on, asked of its replay endpoint."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(timeout_ms), "no answer from the replay endpoint"
            empty, *frames = dealer.recv_multipart()
            assert empty == b"" and len(frames) == 3, frames
            if frames[1] == (-1).to_bytes(8, "big", signed=True):
                return replayed
            replayed.append(message(frames))
    finally:
        dealer.close()


@dataclass
class Index:
    """What the stream says the publisher's prefix index holds: block hash -> (parent hash, its tokens)."""

    blocks: dict[bytes, tuple[bytes | None, list[int]]] = field(default_factory=dict)
    removed: int = 0
    cleared: int = 0

    def apply(self, batch: list) -> None:
        ts, events, rank = batch
        assert isinstance(ts, float) and rank == 0
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                assert set(event) == STORED_KEYS and event["medium"] == "GPU" and event["group_idx"] == 0
                size, tokens = event["block_size"], event["token_ids"]
                assert len(tokens) == size * len(event["block_hashes"]), event
                parent = event["parent_block_hash"]
                for i, block_hash in enumerate(event["block_hashes"]):
                    self.blocks[block_hash] = (parent, tokens[i * size : (i + 1) * size])
                    parent = block_hash
            elif kind == "BlockRemoved":
                assert set(event) == REMOVED_KEYS, event
                for block_hash in event["block_hashes"]:
                    assert block_hash in self.blocks, "a block removed that was never stored"
                    del self.blocks[block_hash]
                    self.removed += 1
            else:
                assert event == {"type": "AllBlocksCleared"}, event
                self.blocks.clear()
                self.removed, self.cleared = 0, self.cleared + 1

    def prefix(self, block_hash: bytes) -> list[int] | None:
        """The tokens of the whole prefix the block ends (None if a block before it is not held)."""
        tokens: list[int] = []
        while block_hash is not None:
            if block_hash not in self.blocks:
                return None
            block_hash, own = self.blocks[block_hash]
            tokens[:0] = own
        return tokens

    def leading_blocks(self, token_ids: list[int], block_size: int) -> int:
        """How many leading full blocks of token_ids the index holds, as a chain from the first."""
        held = {tuple(p) for p in map(self.prefix, self.blocks) if p is not None}
        n = 0
        while len(token_ids) >= (n + 1) * block_size and tuple(token_ids[: (n + 1) * block_size]) in held:
            n += 1
        return n
