"""Admission of prompts sharing a long cached prefix, with real processes (a tiny random-weight model,
services on unix sockets, a pool of 96 blocks): the shared prefix takes 64 of them. Prefix hits on blocks a
running sequence holds take no free block, so requests that arrive together are admitted together and
decode side by side, instead of one after another; every one reports the shared prefix as cached, and every
block is back once they end."""

import random
import threading
import time

import pytest

from common.server import channel
from protos import cache_pb2, cache_pb2_grpc
from sdk.client import Client
from tests.helpers import free_port, socket_dir, stop
from tests.kv_stack import BLOCK_SIZE, Stack
from tests.processes import segments_of
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e
NUM_BLOCKS = 96
rng = random.Random(7)
SHARED = [rng.randrange(3, 256) for _ in range(64 * BLOCK_SIZE)]  # 2/3 of the pool
QUESTIONS = [[rng.randrange(3, 256) for _ in range(8)] for _ in range(5)]
# NOTE: 64 shared blocks plus 4 of each request's own (question and answer): 84 of 96 blocks.
ANSWER = dict(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tokenizer):
    model = save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", max_position_embeddings=2048)
    tokenizer.save_pretrained(model)
    with socket_dir() as sockets:
        svc = Stack(model, sockets, tmp_path_factory.mktemp("logs"))
        try:
            svc.start_cache("--kv-blocks", str(NUM_BLOCKS))
            svc.start_rest(free_port())
            yield svc
        finally:
            codes = [stop(proc) for proc in reversed(svc.procs)]
        assert not any(map(segments_of, [proc.pid for proc in svc.caches])), "a segment was left in /dev/shm"
        assert set(codes) == {0}, codes


def cache_stats(stack: Stack) -> cache_pb2.CacheStats:
    with channel(stack.cache_target) as ch:
        return cache_pb2_grpc.CacheStub(ch).GetStats(cache_pb2.GetStatsRequest(), timeout=10)


def watch_sequences(stack: Stack, done: threading.Event, seen: list[int]) -> None:
    """Appends the cache's count of held block tables every 10 ms until `done`."""
    while not done.is_set():
        seen.append(cache_stats(stack).num_sequences)
        time.sleep(0.01)


def test_requests_sharing_a_cached_prefix_run_side_by_side(stack):
    with Client(stack.gateway_target, timeout=120) as client:
        first = client.generate(token_ids=SHARED + QUESTIONS[0], **ANSWER)
    assert first.usage.cached_tokens == 0
    results: dict[int, object] = {}

    def ask(index: int) -> None:
        with Client(stack.gateway_target, timeout=120) as client:
            results[index] = client.generate(token_ids=SHARED + QUESTIONS[index], **ANSWER)

    done, seen = threading.Event(), []
    watcher = threading.Thread(target=watch_sequences, args=(stack, done, seen))
    askers = [threading.Thread(target=ask, args=(i,)) for i in range(1, len(QUESTIONS))]
    watcher.start()
    try:
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join(120)
    finally:
        done.set()
        watcher.join(30)
    assert sorted(results) == list(range(1, len(QUESTIONS)))
    assert max(seen) == len(askers), f"at most {max(seen)} of {len(askers)} requests held blocks at once"
    cached = [results[i].usage.cached_tokens for i in sorted(results)]
    assert all(tokens >= len(SHARED) for tokens in cached), cached
    stats = cache_stats(stack)
    assert (stats.used_blocks, stats.num_sequences) == (0, 0), "every block is back once the requests ended"
    assert stats.free_blocks + stats.cached_blocks == NUM_BLOCKS
    with Client(stack.gateway_target, timeout=120) as client:
        alone = client.generate(token_ids=SHARED + QUESTIONS[1], **ANSWER)
    assert alone.token_ids == results[1].token_ids, "running beside others changed a greedy answer"
