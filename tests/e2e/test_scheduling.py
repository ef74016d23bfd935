"""The scheduler on real services under a small KV budget: preemption by recompute, chunked prefill beside
decodes, cancellation and deadlines mid-prefill, timings."""

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from common.server import channel
from protos.generation_pb2_grpc import GenerationStub
from sdk.client import GenerationError, build_request
from tests.e2e.greedy import TIE, hf_greedy
from tests.e2e.stack import SMALL_BUDGET, preemptions, start_stack
from tests.helpers import log_events

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny_stack(tiny_model, logs):
    """The tiny model behind 48 blocks of 16 tokens."""
    stack = start_stack(logs, "--model", str(tiny_model), "--dtype", "float32", "--kv-blocks", "48",
                        "--max-batched-tokens", "256", "--max-seqs", "64")  # fmt: skip
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def serial_stack(tiny_model, logs):
    """The tiny model serving one sequence at a time: the queue order shows."""
    stack = start_stack(logs, "--model", str(tiny_model), "--dtype", "float32", "--max-seqs", "1")
    yield stack
    stack.stop()


def workload(count: int, vocab: int, seed: int, new_tokens: tuple[int, int]) -> list[tuple[list[int], int]]:
    """(prompt of 4-120 random tokens, new_tokens[0]-new_tokens[1] new tokens) per request."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(4, 120))], rng.randint(*new_tokens))
        for _ in range(count)
    ]


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


def greedy(client, prompt: list[int], max_tokens: int, **kwargs):
    return client.generate(
        token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs
    )


def run_concurrently(stack, requests) -> list:
    with stack.client() as client, ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: greedy(client, *r), requests))


def streams_match_their_runs_alone(
    stack, count: int, vocab: int, seed: int, new_tokens: tuple[int, int]
) -> None:
    """`count` concurrent greedy streams: preempted (counted in the gateway's metrics), all complete, all
    blocks back, and each output equals the same request run alone afterwards.

    NOTE: batched, chunked differently or recomputed, a sequence's float32 logits differ from its run alone
    by rounding, so on random prompts (flat distributions) a near-tie may go the other way: an output may
    leave the reference only where the reference's top two tokens are within TIE of each other.
    """
    requests = workload(count, vocab, seed, new_tokens)
    before = preemptions(stack)
    results = run_concurrently(stack, requests)
    assert preemptions(stack) > before, "the budget is meant to force preemption"
    stats = stack.stats()
    assert (stats.used_blocks, stats.num_sequences) == (0, 0)
    with stack.client() as client:
        # A salt of its own: computed from scratch, not from blocks the concurrent run left cached.
        alone = [
            greedy(client, *r, cache_salt=f"alone-{seed}-{i}", logprobs=2) for i, r in enumerate(requests)
        ]
    for i, (result, reference) in enumerate(zip(results, alone, strict=True)):
        assert result.finish_reason == "length"
        assert len(result.token_ids) == len(reference.token_ids)
        differ = [
            k
            for k, pair in enumerate(zip(result.token_ids, reference.token_ids, strict=True))
            if pair[0] != pair[1]
        ]
        if differ:
            (first, second), at = reference.logprobs[differ[0]].top, differ[0]
            assert first[1] - second[1] < TIE, f"request {i} diverged at token {at} without a near-tie"
            assert result.token_ids[at] == second[0], f"request {i} took neither of the top two at {at}"


def test_64_streams_over_a_small_kv_budget_all_complete_as_if_alone(tiny_stack):
    # NOTE: the tiny model's steps take milliseconds: streams of 12-40 tokens outlive the time all 64 take to
    # arrive, so they hold blocks together and the 48 blocks run out however fast the machine.
    streams_match_their_runs_alone(tiny_stack, 64, vocab=256, seed=1, new_tokens=(12, 40))


def test_64_streams_of_the_real_model_complete_as_if_alone(small_stack):
    # NOTE: 24 blocks and at most 12 running sequences for 64 streams: a pure simulation of this scheduler on
    # these lengths preempts 12 times however the requests arrive.
    streams_match_their_runs_alone(small_stack, 64, vocab=49152, seed=2, new_tokens=(2, 12))


def test_a_preempted_request_is_recomputed_from_the_blocks_it_had_written(tiny_stack):
    """Two long requests outgrow the 48 blocks while decoding; the later one is preempted, and its written
    blocks are cached when it is freed, so its recompute finds them."""
    first, second = (random_prompt(300, seed=7), 200), (random_prompt(250, seed=8), 150)
    first = ([t % 256 for t in first[0]], first[1])
    second = ([t % 256 for t in second[0]], second[1])
    before, hits = preemptions(tiny_stack), tiny_stack.stats().prefix_hit_tokens
    with tiny_stack.client() as client, ThreadPoolExecutor(2) as pool:
        stream = client.stream(token_ids=first[0], max_tokens=first[1], temperature=0.0, ignore_eos=True)
        tokens = next(stream).token_ids
        later = pool.submit(greedy, client, *second)
        tokens += [t for chunk in stream for t in chunk.token_ids]
        results = [tokens, later.result().token_ids]
    assert preemptions(tiny_stack) > before
    found = tiny_stack.stats().prefix_hit_tokens - hits
    assert found >= 8 * 16, f"the recompute found only {found} tokens cached"
    with tiny_stack.client() as client:
        alone = [
            greedy(client, *r, cache_salt=f"alone-long-{i}").token_ids for i, r in enumerate((first, second))
        ]
    assert results == alone


class Background:
    """Greedy streams that record when each of their tokens arrived."""

    def __init__(self, stack, count: int, max_tokens: int, seed: int) -> None:
        self.requests = [(p[:12], max_tokens) for p, _ in workload(count, 49152, seed, (2, 12))]
        self.arrivals: list[list[float]] = [[] for _ in range(count)]
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self._client = stack.client()
        self._threads = [threading.Thread(target=self._stream, args=(i,)) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _stream(self, i: int) -> None:
        prompt, max_tokens = self.requests[i]
        for chunk in self._client.stream(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                         ignore_eos=True):  # fmt: skip
            self.arrivals[i].append(time.monotonic())
            self.tokens[i].extend(chunk.token_ids)

    def wait_for(self, tokens: int) -> None:
        deadline = time.monotonic() + 120
        while min(map(len, self.arrivals)) < tokens:
            assert time.monotonic() < deadline, "background streams stalled"
            time.sleep(0.01)

    def received(self, i: int, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.arrivals[i])

    def gaps(self, start: float, end: float) -> list[float]:
        pairs = [pair for times in self.arrivals for pair in zip(times, times[1:], strict=False)]
        return [b - a for a, b in pairs if start <= a and b <= end]

    def join(self) -> None:
        for thread in self._threads:
            thread.join(300)
        self._client.close()


def steps_of(stack, request_id: str) -> list[list[list]]:
    """The `chunks` of every step (gateway debug log) that computed tokens of the request."""
    steps = []
    for event in log_events(stack.proc.log_path):
        if event["event"] == "step" and any(c[0] == request_id for c in event["chunks"]):
            steps.append(event["chunks"])
    return steps


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(small_stack, hf_models):
    background = Background(small_stack, count=2, max_tokens=48, seed=3)
    background.wait_for(6)
    prompt = random_prompt(4 * SMALL_BUDGET - 20, seed=4)  # over 3 steps' budget
    submitted = time.monotonic()
    with small_stack.client() as client:
        stream = client.stream(token_ids=prompt, max_tokens=2, temperature=0.0, request_id="long-prompt",
                               cache_salt="long")  # fmt: skip
        first = next(stream)
        first_at = time.monotonic()
        tokens = first.token_ids + [t for chunk in stream for t in chunk.token_ids]
    background.join()
    assert tokens == hf_greedy(hf_models(torch.float32), prompt, 2), "chunked prefill computes the same"
    steps = steps_of(small_stack, "long-prompt")
    prefill = [next(c[2] for c in chunks if c[0] == "long-prompt") for chunks in steps[:-1]]
    room = SMALL_BUDGET - 2  # the budget left beside the two background decodes
    assert prefill == [room] * 3 + [len(prompt) - 3 * room], "one chunk per step, as large as the budget"
    for chunks in steps[:-1]:
        assert sorted(c[2] for c in chunks)[:2] == [1, 1], (
            f"the background decodes ran in every chunk: {chunks}"
        )
    for i in range(2):
        assert background.received(i, submitted, first_at) >= len(prefill) - 1
    assert len(first.token_ids) == 1
    before = statistics.median(background.gaps(0, submitted))
    during = statistics.median(background.gaps(submitted, first_at))
    print(
        f"\nbackground inter-token gap: median {before * 1000:.0f} ms before, {during * 1000:.0f} ms "
        f"during the {len(prefill)}-chunk prefill of {len(prompt)} tokens"
    )
    assert small_stack.stats().used_blocks == 0


def _mid_prefill(stack, request_id: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not steps_of(stack, request_id):
        assert time.monotonic() < deadline, f"{request_id} never ran"
        time.sleep(0.02)


def _blocks_back(stack, background: Background, sequences: int) -> int:
    """Waits until the cache holds only `sequences` sequences; returns the tokens background stream 0 got
    while a reply still showed more.
    NOTE: counted up to the last such reply, not the first one showing fewer: a loaded machine may answer a
    poll late, and the tokens decoded meanwhile came after the blocks were back."""
    start = held_until = time.monotonic()
    while stack.stats().num_sequences > sequences:
        held_until = time.monotonic()
        assert held_until - start < 60
        time.sleep(0.005)
    return background.received(0, start, held_until)


def _handler_ended(stack, request_id: str) -> bool:
    for event in log_events(stack.proc.log_path):
        if event["event"] == "rpc_refused" and request_id in event.get("request_id", "").split(","):
            return event["code"] == "CANCELLED"
    return False


def _half_a_prefill(stack, prompt: list[int]) -> float:
    """Half of what the prompt's prefill (beside what runs now, under a salt of its own) takes here."""
    with stack.client() as client:
        probe = greedy(client, prompt, 1, cache_salt="deadline-probe")
    return (probe.timings.time_to_first_token_s - probe.timings.queue_s) / 2


def _end(stack, prompt: list[int], request_id: str, timeout: float | None) -> None:
    """Sends a request of `prompt`; ends it by cancelling it once its prefill ran (`timeout` None), else by
    that deadline (unless it finished first)."""
    request = build_request(token_ids=prompt, max_tokens=20, temperature=0.0, request_id=request_id,
                            cache_salt=request_id)  # fmt: skip
    with channel(stack.target) as ch:
        if timeout is None:
            call = GenerationStub(ch).Generate(request)
            _mid_prefill(stack, request_id)
            call.cancel()
            return
        try:
            list(GenerationStub(ch).Generate(request, timeout=timeout))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_request_ended_mid_prefill_frees_its_blocks_within_a_step(small_stack, how):
    prompt = random_prompt(5 * SMALL_BUDGET, seed=6)  # 6 chunks beside the two decodes
    chunks = -(-len(prompt) // (SMALL_BUDGET - 2))
    timeout = None
    for attempt in range(4):
        background = Background(small_stack, count=2, max_tokens=30, seed=5)
        background.wait_for(2)
        if how == "deadline" and timeout is None:
            timeout = _half_a_prefill(small_stack, prompt)
        request_id = f"ended-{how}-{attempt}"
        _end(small_stack, prompt, request_id, timeout)
        if len(steps_of(small_stack, request_id)) < chunks:
            break
        # NOTE: a machine that slowed down since the probe may run the whole prefill within the deadline: the
        # request is sent again, beside new decodes, with half the time.
        assert how == "deadline", "the request was cancelled mid-prefill, yet its prefill ran whole"
        background.join()
        timeout /= 2
    else:
        pytest.fail(f"the prefill of {len(prompt)} tokens ran whole within each deadline, to {timeout:.3f}s")
    assert _blocks_back(small_stack, background, sequences=2) <= 2, "freed within one step"
    background.join()
    assert small_stack.stats().used_blocks == 0
    assert _handler_ended(small_stack, request_id), "the gateway's RPC thread for it ended too"
    with small_stack.client() as client:
        alone = [greedy(client, p, n, cache_salt=f"{how}-alone-{i}").token_ids
                 for i, (p, n) in enumerate(background.requests)]  # fmt: skip
    assert background.tokens == alone


def test_waiting_requests_are_served_by_priority_then_arrival(serial_stack):
    order, lock = [], threading.Lock()

    def request(name: str, priority: int) -> None:
        with serial_stack.client() as client:
            client.generate(token_ids=[5, 6, 7], max_tokens=4, priority=priority, ignore_eos=True)
        with lock:
            order.append(name)

    with serial_stack.client() as client, ThreadPoolExecutor(4) as pool:
        # NOTE: as long as the tiny model allows (512 tokens), so the others queue behind it on a fast machine
        running = client.stream(token_ids=[9, 10, 11], max_tokens=500, ignore_eos=True)
        next(running)
        jobs = []
        for name, priority in (("late", 5), ("normal-1", 0), ("urgent", -3), ("normal-2", 0)):
            jobs.append(pool.submit(request, name, priority))
            time.sleep(0.05)  # distinct arrivals
        time.sleep(0.2)
        assert (len(order), serial_stack.stats().num_sequences) == (0, 1), "all queued behind the first"
        list(running)
        for job in jobs:
            job.result()
    assert order == ["urgent", "normal-1", "normal-2", "late"]


def test_timings_are_present_and_ordered(tiny_stack):
    with tiny_stack.client() as client:
        samples = client.generate_n(token_ids=list(range(5, 40)), n=2, max_tokens=4, temperature=0.8, seed=1)
    for sample in samples:
        t = sample.timings
        assert 0 <= t.queue_s <= t.time_to_first_token_s <= t.total_s
        assert t.total_s > 0


def test_more_samples_than_max_seqs_are_refused(small_stack):
    with small_stack.client() as client, pytest.raises(GenerationError) as err:
        client.generate_n(prompt="hi", n=13, max_tokens=2)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 12 sequences at once (--max-seqs)" in err.value.details
    assert small_stack.stats().used_blocks == 0
