"""Prefix sharing, copy-on-write and n > 1 sampling through the running stack (real model, float32)."""

import threading
import time

import grpc
import pytest

from sdk.client import GenerationError
from tests.e2e.prompts import prompt_ids
from tests.e2e.stack import start_stack

pytestmark = pytest.mark.e2e

NEW_TOKENS = 8
TOY = "tests.toy_allocator:StackAllocator"


@pytest.fixture(scope="module")
def stack_uncached(model_dir, logs):
    """No prefix cache, and a third-party allocator given by dotted path."""
    stack = start_stack(
        logs, "--dtype", "float32", "--kv-blocks", "512", "--no-prefix-cache", "--allocator", TOY
    )
    yield stack
    stack.stop()


def shared_prompts(tokenizer, count: int) -> list[list[int]]:
    (system,) = prompt_ids(tokenizer, [400])
    return [system + tokenizer.encode(f" Question {i}: what is {i} times {i + 3}?") for i in range(count)]


def greedy(client, token_ids: list[int], **options) -> list[int]:
    options = {"temperature": 0.0, "ignore_eos": True, **options}
    return client.generate(token_ids=token_ids, max_tokens=NEW_TOKENS, **options).token_ids


def run_all(client, prompts: list[list[int]], **options) -> list[list[int]]:
    outputs: list = [None] * len(prompts)

    def one(i: int) -> None:
        outputs[i] = greedy(client, prompts[i], **options)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outputs


def test_sixteen_requests_share_a_system_prompt(stack_fp32, stack_uncached, tokenizer):
    prompts = shared_prompts(tokenizer, 16)
    before = stack_fp32.stats()
    bs = before.block_size
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], stack_fp32.stats().used_blocks)
            done.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with stack_fp32.client() as client:
        first = greedy(client, prompts[0])
        rest = run_all(client, prompts[1:])
    done.set()
    watcher.join()
    after = stack_fp32.stats()

    unique = sum(len(p) - 400 for p in prompts)
    computed = (after.prefix_query_tokens - after.prefix_hit_tokens) - (
        before.prefix_query_tokens - before.prefix_hit_tokens
    )
    assert computed <= 400 + unique + 16 * bs, computed
    suffix_blocks = max(-(-(len(p) - 400 + NEW_TOKENS) // bs) for p in prompts) + 1
    assert peak[0] <= 400 // bs + 15 * suffix_blocks, peak[0]
    assert after.used_blocks == 0 and after.cached_blocks > 0

    with stack_uncached.client() as client:
        uncached = [greedy(client, prompts[0]), *run_all(client, prompts[1:])]
    assert [first, *rest] == uncached
    stats = stack_uncached.stats()
    assert (stats.prefix_caching, stats.prefix_hit_tokens, stats.cached_blocks) == (False, 0, 0)
    assert stats.used_blocks == 0


def test_requests_admitted_together_compute_their_shared_prompt_once(stack_fp32, stack_uncached, tokenizer):
    """Eight requests queued behind a long prefill are admitted in one step: the first computes the system
    prompt, the others read its K/V written in that same forward, and every output equals the uncached one."""
    prompts = shared_prompts(tokenizer, 8)
    (blocker,) = prompt_ids(tokenizer, [1500])
    before = stack_fp32.stats()
    with stack_fp32.client() as client:
        # salts of their own: nothing cached before, and the blocker (whose text starts alike) shares nothing
        busy = threading.Thread(target=greedy, args=(client, blocker), kwargs={"cache_salt": "blocker"})
        busy.start()
        time.sleep(1.0)  # the blocker's prefill runs; the eight queue behind it
        outputs = run_all(client, prompts, cache_salt="admitted-together")
        busy.join()
    after = stack_fp32.stats()
    computed = (after.prefix_query_tokens - after.prefix_hit_tokens) - (
        before.prefix_query_tokens - before.prefix_hit_tokens
    )
    unique = sum(len(p) - 400 for p in prompts)
    assert computed - len(blocker) <= 400 + unique + 8 * before.block_size, computed
    assert after.used_blocks == 0
    with stack_uncached.client() as client:
        assert outputs == run_all(client, prompts)


def test_n_samples_share_the_prompt_and_copy_on_write(stack_fp32, tokenizer):
    # A text no other test starts with (a cached block of it would also serve a partial prefix hit);
    # 37 tokens end inside a block: the first write of every sample copies it.
    prompt = prompt_ids(tokenizer, [800])[0][750:787]
    cows = stack_fp32.stats().copy_on_writes
    with stack_fp32.client() as client:
        single = greedy(client, prompt)
        greedy4 = client.generate_n(
            token_ids=prompt, n=4, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True
        )
        assert [c.token_ids for c in greedy4] == [single] * 4
        assert all(c.usage.completion_tokens == NEW_TOKENS for c in greedy4)
        assert greedy4[0].usage.cached_tokens == 32, "the second request hit the first's two full blocks"
        assert stack_fp32.stats().copy_on_writes > cows

        def sampled() -> list[list[int]]:
            kw = {"max_tokens": NEW_TOKENS, "temperature": 1.0, "seed": 11, "ignore_eos": True}
            return [c.token_ids for c in client.generate_n(token_ids=prompt, n=4, **kw)]

        first = sampled()
        assert first == sampled(), "seeded samples are reproducible"
        assert len({tuple(t) for t in first}) > 1, "sample i draws with seed + i"
        with_seed_12 = client.generate(
            token_ids=prompt, max_tokens=NEW_TOKENS, temperature=1.0, seed=12, ignore_eos=True
        )
        assert with_seed_12.token_ids == first[1]
    stats = stack_fp32.stats()
    assert stats.used_blocks == 0 and stats.num_sequences == 0


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused(stack_fp32, n):
    with stack_fp32.client() as client, pytest.raises(GenerationError) as err:
        client.generate_n(prompt="hi", n=n)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.n must be in [1, 16]" in err.value.details


def test_a_prefix_ending_inside_a_block_reuses_a_copy_of_it(stack_fp32, stack_uncached, tokenizer):
    (text,) = prompt_ids(tokenizer, [80])
    first, second = text[40:80], text[40:64] + text[:16]  # they share 24 tokens: 1.5 blocks of 16
    with stack_fp32.client() as client:
        client.generate(token_ids=first, max_tokens=2, temperature=0.0, ignore_eos=True)
        copies = stack_fp32.stats().copy_on_writes
        result = client.generate(token_ids=second, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert result.usage.cached_tokens == 24, "one whole block shared, 8 tokens from a copy of the next"
    assert stack_fp32.stats().copy_on_writes == copies + 1
    with stack_uncached.client() as client:
        assert result.token_ids == greedy(client, second)
    assert stack_fp32.stats().used_blocks == 0
