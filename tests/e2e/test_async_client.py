"""sdk.client.AsyncClient against the running stack: generate, stream, errors, deadlines."""

import asyncio
import time
from dataclasses import replace

import grpc
import pytest

from sdk.client import AsyncClient, GenerationError

pytestmark = pytest.mark.e2e
PROMPT = "The capital of France is"


def _run(coro):
    return asyncio.run(coro)


def test_generate_and_stream_agree(stack_fp32):
    async def both():
        async with AsyncClient(stack_fp32.target, timeout=300) as client:
            whole = await client.generate(prompt=PROMPT, max_tokens=6, temperature=0)
            chunks = [chunk async for chunk in client.stream(prompt=PROMPT, max_tokens=6, temperature=0)]
            info = await client.info()
        return whole, chunks, info

    whole, chunks, info = _run(both())
    assert "Paris" in whole.text and whole.finish_reason == "length" and whole.usage.completion_tokens == 6
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert info.num_blocks == 512


def test_sampling_controls_match_the_sync_client(stack_fp32):
    controls = dict(prompt=PROMPT, max_tokens=12, temperature=0, stop=".", logprobs=3, repetition_penalty=1.3,
                    request_id="same")  # fmt: skip

    async def generate():
        async with AsyncClient(stack_fp32.target, timeout=300) as client:
            return await client.generate(**controls)

    result = _run(generate())
    with stack_fp32.client() as client:
        expected = client.generate(**controls)
    # timings are the gateway's clock readings of each run; everything else must be equal
    assert result.timings.total_s > 0 and expected.timings.total_s > 0
    assert replace(result, timings=None) == replace(expected, timings=None)
    assert result.finish_reason == "stop" and "." not in result.text
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    assert all(len(lp.top) == 3 for lp in result.logprobs)


def test_refused_request_raises_generation_error_with_code(stack_fp32):
    async def refused():
        async with AsyncClient(stack_fp32.target, timeout=60) as client:
            await client.generate(prompt="hi", max_tokens=-1)

    with pytest.raises(GenerationError) as err:
        _run(refused())
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens must be >= 0" in err.value.details


def test_deadline_ends_the_request_and_frees_its_blocks(stack_fp32):
    async def too_slow():
        async with AsyncClient(stack_fp32.target, timeout=1.0) as client:
            await client.generate(prompt=PROMPT, max_tokens=200, temperature=0, ignore_eos=True)

    start = time.monotonic()
    with pytest.raises(GenerationError) as err:
        _run(too_slow())
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 30
    while stack_fp32.stats().used_blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stack_fp32.stats().used_blocks == 0
