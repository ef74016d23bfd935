"""The cache service's KV events (--kv-events-endpoint) on real processes (cache, compute on a tiny random
model, gateway), read by a real ZMQ SUB socket: a run with prefix hits and evictions, the cache killed and
started again, another run; the stream, with the replay endpoint's answers, is checked against the cache's
GetBlockMap, Lookup and GetStats."""

import signal
from pathlib import Path

import pytest

from cache_service.prefix_cache import block_hash
from common.server import channel
from protos import cache_pb2, cache_pb2_grpc
from sdk.client import Client
from tests.helpers import free_port, socket_dir, start, stop, wait_healthy
from tests.kv_event_stream import Index, Message, Subscriber, replay

pytestmark = pytest.mark.e2e
BLOCK_SIZE, NUM_BLOCKS = 16, 24
# The tiny model's vocabulary is 256 tokens. Three blocks the prompts after the first find cached:
SHARED = [(5 * j + 1) % 256 for j in range(3 * BLOCK_SIZE)]
TOPIC = "kv@pod-a@tiny"


def prompt(i: int, length: int = 40) -> list[int]:
    return [(31 * i + 17 * j + 3) % 256 for j in range(length)]


class Stack:
    """Cache (with KV events on ipc endpoints), compute and gateway processes; the cache can be killed and
    started again on the same port and endpoints."""

    def __init__(self, model: Path, logs: Path, sockets: Path) -> None:
        self.logs, self.starts = logs, 0
        self.endpoint, self.replay = f"ipc://{sockets}/events", f"ipc://{sockets}/replay"
        self.cache_target = f"127.0.0.1:{free_port()}"
        compute, gateway = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.cache = self._start_cache()
        self.subscriber = Subscriber(self.endpoint, TOPIC.encode())
        self.compute = self._start("compute_service", compute, "--model", str(model), "--dtype", "float32",
                                   "--threads", "1", "--insecure")  # fmt: skip
        self.gateway = self._start("gateway", gateway, "--model", str(model), "--block-size", str(BLOCK_SIZE),
                                   "--cache-target", self.cache_target, "--compute-target", compute,
                                   service="pagedserve.v1.Generation")  # fmt: skip
        self.target = gateway
        self.stub = cache_pb2_grpc.CacheStub(channel(self.cache_target))

    def _start(self, module: str, target: str, *args: str, service: str = ""):
        self.starts += 1
        port = target.rsplit(":", 1)[1]
        proc = start(module, "--port", port, *args, log_path=self.logs / f"{module}-{self.starts}.log")
        wait_healthy(target, proc, 120, service)
        return proc

    def _start_cache(self):
        return self._start("cache_service", self.cache_target, "--kv-blocks", str(NUM_BLOCKS), "--insecure",
                           "--kv-events-endpoint", self.endpoint, "--kv-events-topic", TOPIC,
                           "--kv-events-replay-endpoint", self.replay)  # fmt: skip

    def restart_cache(self) -> None:
        self.cache.send_signal(signal.SIGKILL)
        self.cache.wait()
        self.cache = self._start_cache()

    def generate(self, token_ids: list[int]) -> None:
        with Client(self.target, timeout=120) as client:
            client.generate(token_ids=token_ids, max_tokens=8, temperature=0.0, ignore_eos=True)

    def stats(self) -> cache_pb2.CacheStats:
        return self.stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)

    def stop(self) -> tuple[list[int], Message]:
        """The exit codes (SIGTERM), and the last message: the stopping cache's."""
        received = len(self.subscriber.messages())
        codes = [stop(proc) for proc in (self.gateway, self.compute, self.cache)]
        try:
            self.subscriber.wait_for(received + 1)
            self.subscriber.wait_quiet(0.5)
            return codes, self.subscriber.messages()[-1]
        finally:
            self.subscriber.close()


def run(stack: Stack, first: int) -> cache_pb2.CacheStats:
    """Two prompts on the shared prefix (the second hits it), then enough others to evict; the stats after."""
    for i in range(2):
        stack.generate(SHARED + prompt(first + i, 10))
    for i in range(2, 8):
        stack.generate(prompt(first + i, 100))
    return stack.stats()


def merged(received: list[Message], replayed: list[Message]) -> list[Message]:
    by_seq = {msg.seq: msg for msg in (*received, *replayed)}
    return [by_seq[seq] for seq in sorted(by_seq)]


@pytest.fixture(scope="module")
def stream(tmp_path_factory, tiny_model):
    """Both runs' messages (each process's gaps filled from its replay endpoint) and each run's stats."""
    with socket_dir() as sockets:
        stack = Stack(tiny_model, tmp_path_factory.mktemp("kv-events-logs"), sockets)
        try:
            before = run(stack, 0)
            stack.subscriber.wait_quiet()
            received = stack.subscriber.messages()
            first = merged(received, replay(stack.replay))
            stack.restart_cache()
            after = run(stack, 100)
            stack.subscriber.wait_quiet()
            second = merged(stack.subscriber.messages()[len(received) :], replay(stack.replay))
            yield stack, first, second, before, after
        finally:
            codes, last = stack.stop()
    assert codes == [0, 0, 0]
    assert last.batch[1][-1] == {"type": "AllBlocksCleared"}, "a stopping cache clears what it announced"


def test_each_process_numbers_its_batches_from_zero_and_starts_cleared(stream):
    _, first, second, _, _ = stream
    for messages in (first, second):
        assert [msg.seq for msg in messages] == list(range(len(messages))), "no batch lost"
        assert {msg.topic for msg in messages} == {TOPIC.encode()}
        assert messages[0].batch[1][0] == {"type": "AllBlocksCleared"}


def test_both_runs_had_prefix_hits_and_evictions(stream):
    _, first, second, before, after = stream
    for stats, messages in ((before, first), (after, second)):
        assert stats.prefix_hit_tokens >= len(SHARED) and stats.evictions > 0
        index = Index()
        for msg in messages:
            index.apply(msg.batch)
        assert index.removed == stats.evictions, "one BlockRemoved hash per eviction"


def test_the_stream_holds_what_the_block_map_and_lookup_say(stream):
    stack, _, second, _, after = stream
    index = Index()
    for msg in second:
        index.apply(msg.batch)
    block_map = stack.stub.GetBlockMap(cache_pb2.GetBlockMapRequest(), timeout=10)
    cached = [b for b, state in enumerate(block_map.states) if state == cache_pb2.BLOCK_STATE_CACHED]
    assert after.used_blocks == 0 and len(index.blocks) == len(cached) == after.cached_blocks
    prompts = [SHARED + prompt(100 + i, 10) for i in range(2)] + [prompt(100 + i, 100) for i in range(2, 8)]
    seqs = [
        cache_pb2.SequenceRequest(seq_id=f"q{i}", num_tokens=len(p), token_ids=p)
        for i, p in enumerate(prompts)
    ]
    reply = stack.stub.Lookup(cache_pb2.LookupRequest(seqs=seqs), timeout=10)
    held = [index.leading_blocks(p[: len(p) - 1], BLOCK_SIZE) for p in prompts]
    assert [n * BLOCK_SIZE for n in held] == list(reply.cached_tokens)
    assert any(held) and not all(held), "some prompts evicted, some still cached"
    for blocks in reply.prefix_blocks:
        assert all(block_map.states[b] == cache_pb2.BLOCK_STATE_CACHED for b in blocks.block_ids)


def test_hashes_chain_over_parents_and_tokens(stream):
    _, first, second, _, _ = stream
    for messages in (first, second):
        for msg in messages:
            for event in msg.batch[1]:
                if event["type"] != "BlockStored":
                    continue
                parent, size = event["parent_block_hash"], event["block_size"]
                for i, own in enumerate(event["block_hashes"]):
                    if parent is not None:
                        assert own == block_hash(parent, event["token_ids"][i * size : (i + 1) * size])
                    parent = own
