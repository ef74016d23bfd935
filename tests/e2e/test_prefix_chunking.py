"""Prefix-aware chunk sizing with real processes (a tiny random-weight model, services on unix sockets): a
request whose long prefix is cached arrives while another prompt is prefilling under a small
--max-batched-tokens; its cached_tokens covers the whole shared prefix (cached tokens cost no budget: the
first chunk starts after them), and its output is the one computed without the cache."""

import random
import threading
import time

import pytest

from common.server import channel
from protos import cache_pb2, cache_pb2_grpc
from sdk.client import Client
from tests.helpers import free_port, socket_dir, stop
from tests.kv_stack import BLOCK_SIZE, GREEDY, Stack
from tests.processes import segments_of
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e
BUDGET = 128  # --max-batched-tokens: the shared prefix takes 8 steps to compute
rng = random.Random(14)
SHARED = [rng.randrange(3, 256) for _ in range(64 * BLOCK_SIZE)]
QUESTIONS = [[rng.randrange(3, 256) for _ in range(20)] for _ in range(5)]
LONG = [rng.randrange(3, 256) for _ in range(2000)]  # an unrelated prompt, prefilled over 16 steps


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tokenizer):
    model = save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", max_position_embeddings=4096)
    tokenizer.save_pretrained(model)
    with socket_dir() as sockets:
        svc = Stack(model, sockets, tmp_path_factory.mktemp("logs"))
        try:
            svc.start_cache("--kv-blocks", "512")
            svc.start_rest(free_port(), "--max-batched-tokens", str(BUDGET))
            yield svc
        finally:
            codes = [stop(proc) for proc in reversed(svc.procs)]
        assert not any(map(segments_of, [proc.pid for proc in svc.caches])), "a segment was left in /dev/shm"
        assert set(codes) == {0}, codes


def test_a_cached_prefix_costs_no_budget_while_another_prompt_prefills(stack):
    first = stack.generate(SHARED + QUESTIONS[0])
    assert first.usage.cached_tokens == 0
    results: dict[int, object] = {}

    def ask(index: int) -> None:
        with Client(stack.gateway_target, timeout=120) as client:
            results[index] = client.generate(token_ids=SHARED + QUESTIONS[index], **GREEDY)

    with Client(stack.gateway_target, timeout=120) as client:
        long = threading.Thread(target=lambda: client.generate(token_ids=LONG, **GREEDY))
        long.start()
        time.sleep(0.05)  # NOTE: the long prompt's prefill takes every step's budget for 16 steps
        askers = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
        for asker in askers:
            asker.start()
        for thread in (long, *askers):
            thread.join(120)
    assert sorted(results) == list(range(len(QUESTIONS)))
    cached = [results[i].usage.cached_tokens for i in range(len(QUESTIONS))]
    assert all(tokens >= len(SHARED) for tokens in cached), cached
    assert results[0].token_ids == first.token_ids, "the cached prefix changed the greedy output"
    with channel(stack.cache_target) as ch:
        stats = cache_pb2_grpc.CacheStub(ch).GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    assert stats.used_blocks == 0, "every block is back once the requests ended"
