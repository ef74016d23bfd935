"""The Redis KV tier with real processes: two stacks (a tiny random-weight model, services on unix sockets)
share one real redis-server. A prompt computed on the first is served from the tier on the second, with the
output of a tier-less stack; with Redis stopped requests still complete (recomputed, tier errors counted),
and the tier resumes once Redis is back on the same port."""

import contextlib
import random
import time

import pytest

from cache_service.tiers.redis import RETRY_AFTER_S
from tests.helpers import free_port, socket_dir, stop
from tests.kv_stack import Stack
from tests.processes import segments_of
from tests.redis_server import RedisServer
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e
SYSTEM_TOKENS = 1600  # 100 blocks
rng = random.Random(17)
SYSTEMS = [[rng.randrange(3, 256) for _ in range(SYSTEM_TOKENS)] for _ in range(3)]
QUESTIONS = [[rng.randrange(3, 256) for _ in range(20)] for _ in range(2)]
PROMPTS = [system + question for system in SYSTEMS for question in QUESTIONS]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, tokenizer, redis_server):
    """Two stacks; the first's cache starts without a tier (for the reference outputs)."""
    model = save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", max_position_embeddings=4096)
    tokenizer.save_pretrained(model)
    logs = tmp_path_factory.mktemp("logs")
    with contextlib.ExitStack() as exits:
        pair = [Stack(model, exits.enter_context(socket_dir()), logs / str(n)) for n in range(2)]
        try:
            for stack in pair:
                stack.logs.mkdir()
            pair[0].start_cache()
            pair[1].start_cache(*tier_flags(redis_server))
            for stack in pair:
                stack.start_rest(free_port())
            yield pair
        finally:
            procs = [proc for stack in pair for proc in reversed(stack.procs)]
            codes = {proc.pid: stop(proc) for proc in procs}
        caches = [proc.pid for stack in pair for proc in stack.caches]
        assert not any(map(segments_of, caches)), "a segment was left in /dev/shm"
        assert set(codes.values()) == {0}, codes


@pytest.fixture(scope="module")
def reference(stacks):
    """The tier-less outputs of every prompt, from the first stack before its cache gets the tier."""
    assert not stacks[0].tier().name, "no tier yet"
    return {tuple(prompt): stacks[0].generate(prompt).token_ids for prompt in PROMPTS}


def tier_flags(server: RedisServer) -> tuple[str, ...]:
    # NOTE: 640 blocks: room for every prompt's blocks, as the tier loads into free blocks only.
    url = server.url + "?timeout=0.2"
    return ("--kv-tier", "redis", "--kv-tier-path", url, "--kv-tier-hot", "0", "--kv-blocks", "640")


def written(stack: Stack, blocks: int) -> None:
    """Waits (at most 30 s) until the stack's cache has stored `blocks` blocks in the tier."""
    deadline = time.monotonic() + 30
    while stack.tier().written_blocks < blocks:
        assert time.monotonic() < deadline, stack.tier()
        time.sleep(0.1)


def test_a_prompt_computed_on_one_stack_is_served_from_redis_on_the_other(stacks, reference, redis_server):
    first, second = stacks
    first.stop_cache()
    first.start_cache(*tier_flags(redis_server))
    computed = first.generate(SYSTEMS[0] + QUESTIONS[0])
    assert computed.usage.cached_tokens == 0
    written(first, (len(computed.token_ids) + SYSTEM_TOKENS + 20) // 16)
    served = second.generate(SYSTEMS[0] + QUESTIONS[1])
    assert served.usage.cached_tokens == SYSTEM_TOKENS, "the second stack loaded the system prompt from Redis"
    assert served.token_ids == reference[tuple(SYSTEMS[0] + QUESTIONS[1])], "identical to the tier-less stack"
    stats = second.tier()
    assert (stats.name, stats.hit_blocks, stats.errors) == ("redis", SYSTEM_TOKENS // 16, 0)
    assert "redis://127.0.0.1" in stats.location
    ttft = computed.timings.time_to_first_token_s, served.timings.time_to_first_token_s
    per_block = stats.load_seconds / stats.hit_blocks * 1e3
    print(f"tiny model, {SYSTEM_TOKENS}-token prompt: TTFT computed {ttft[0]:.3f} s, "
          f"from Redis {ttft[1]:.3f} s ({per_block:.2f} ms a block)")  # fmt: skip


def test_requests_complete_while_redis_is_down_and_the_tier_resumes_when_it_returns(
    stacks, reference, redis_server
):
    first, second = stacks
    redis_server.stop()
    for stack in stacks:
        result = stack.generate(SYSTEMS[1] + QUESTIONS[0])
        assert result.token_ids == reference[tuple(SYSTEMS[1] + QUESTIONS[0])], "recomputed, unchanged"
        assert result.usage.cached_tokens == 0
        assert stack.tier().errors > 0, "the failed loads and stores are counted"
    redis_server.start()  # the same port, empty (nothing was saved)
    time.sleep(RETRY_AFTER_S)
    before = first.tier().written_blocks
    assert first.generate(SYSTEMS[2] + QUESTIONS[0]).usage.cached_tokens == 0
    written(first, before + SYSTEM_TOKENS // 16)
    served = second.generate(SYSTEMS[2] + QUESTIONS[1])
    assert served.usage.cached_tokens == SYSTEM_TOKENS, "the tier is used again"
    assert served.token_ids == reference[tuple(SYSTEMS[2] + QUESTIONS[1])]
