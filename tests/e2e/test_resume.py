"""Resumable streams against real processes: a cache, a compute (the real model) and two gateways, apart.

A resume (GenerateRequest.resume) from any point continues the fault-free run token for token, greedy and
seeded sampling alike, n samples, stop strings and min_tokens, penalties and logprobs; its text deltas
follow the received ones with nothing repeated, its usage and finish_reason are the fault-free run's. The
SDK resumes streams on the other gateway when one is killed (SIGKILL) or drained, and `pagedserve generate`
moves past a gateway that is down; a resume takes over the running request of its id; the OpenAI API
resumes through its extension fields. No block stays used afterwards."""

import asyncio
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from protos import generation_pb2, generation_pb2_grpc
from sdk import AsyncClient, Client
from sdk.client import build_request
from tests.e2e.cache_process import Service
from tests.e2e.gateway_process import Gateway
from tests.helpers import PAGEDSERVE, ROOT, free_port, start, stop, wait_healthy
from tests.processes import left_by, stopped

pytestmark = pytest.mark.e2e
TTL_S, WAIT_S = 2.0, 120
GATEWAY_FLAGS = ("--session-ttl", str(TTL_S))
# Each a request's keyword arguments (build_request's); every one but the stop case runs to max_tokens.
CASES = {
    "greedy": dict(prompt="Tell me about the lighthouse", max_tokens=40, temperature=0.0, ignore_eos=True),
    "seeded": dict(prompt="Write a short poem about a comet", max_tokens=40, temperature=0.9, top_p=0.95,
                   seed=5, ignore_eos=True),
    "n=2 seeded": dict(prompt="Three facts about the river", n=2, max_tokens=32, temperature=0.8, seed=9,
                       ignore_eos=True),
    "stop string, min_tokens": dict(prompt="Once upon a time, near an old orchard", max_tokens=80,
                                    temperature=0.0, stop=[" the"], min_tokens=12),
    "penalties, logprobs": dict(prompt="List the planets of the solar system", max_tokens=40,
                                temperature=0.7, seed=3, repetition_penalty=1.2, presence_penalty=0.5,
                                logprobs=2, ignore_eos=True),
}  # fmt: skip


class Stack:
    """Gateway 1 serves the OpenAI API on `http_url` too."""

    def __init__(self, cache: Service, compute, gateways: list[Gateway], http_url: str) -> None:
        self.cache, self.compute, self.gateways, self.http_url = cache, compute, gateways, http_url

    def wait_released(self) -> None:
        """Until no block is used and no sequence held (a killed gateway's session lapses)."""
        deadline = time.monotonic() + WAIT_S
        while (stats := self.cache.stats()).used_blocks or stats.num_sequences:
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    cache = Service(tmp, "--kv-blocks", "512")
    compute_target = f"127.0.0.1:{free_port()}"
    compute = start("compute_service", "--port", compute_target.rsplit(":", 1)[1], "--dtype", "float32",
                    "--insecure", log_path=tmp / "compute.log")  # fmt: skip
    gateways = []
    try:
        wait_healthy(compute_target, compute, timeout=300)
        http_port = free_port()
        http = ("--http-port", str(http_port))
        gateways = [Gateway(tmp, f"gateway-{i}", cache, compute_target, *GATEWAY_FLAGS, *http * i)
                    for i in range(2)]  # fmt: skip
        yield Stack(cache, compute, gateways, f"http://127.0.0.1:{http_port}/v1")
    finally:
        for gateway in gateways:
            stop(gateway.proc)
        stop(compute)
        cache.stop()
        assert not left_by([cache.proc.pid])


@pytest.fixture(scope="module")
def references(stack) -> dict[str, list[list[generation_pb2.GenerateResponse]]]:
    """Each case's fault-free responses per sample, from gateway 1, all at once."""
    with ThreadPoolExecutor(len(CASES)) as pool:
        runs = dict(zip(CASES, pool.map(lambda kwargs: responses(stack.gateways[1], kwargs), CASES.values()),
                        strict=True))  # fmt: skip
    assert all(len(sample) >= 12 for run in runs.values() for sample in run), "every sample is long enough"
    (stopped_case,) = runs["stop string, min_tokens"]
    assert stopped_case[-1].finish_reason == generation_pb2.FINISH_REASON_STOP, "the stop string matched"
    return runs


def responses(gateway: Gateway, kwargs: dict, resume: list | None = None, request_id: str = ""):
    """The responses of one Generate call, by sample."""
    request = build_request(**kwargs, request_id=request_id or uuid.uuid4().hex)
    request.resume.extend(resume or ())
    with grpc.insecure_channel(gateway.target) as chan:
        replies = list(generation_pb2_grpc.GenerationStub(chan).Generate(request, timeout=WAIT_S))
    by_sample = [[] for _ in range(kwargs.get("n", 1))]
    for reply in replies:
        by_sample[reply.index].append(reply)
    return by_sample


def tokens(replies) -> list[int]:
    return [t for reply in replies for t in reply.token_ids]


def text(replies) -> str:
    return "".join(reply.text for reply in replies)


def logprobs(replies) -> list[generation_pb2.TokenLogprobs]:
    return [lp for reply in replies for lp in reply.logprobs]


@pytest.mark.parametrize("case", list(CASES))
def test_a_resume_from_any_point_continues_the_fault_free_run(stack, references, case):
    """The resume goes to the other gateway (gateway 0): only what the request says carries over. The
    resumes from the four cut points are sent at once."""
    reference = references[case]
    assert all(len(reply.token_ids) == 1 for sample in reference for reply in sample), "a token a response"
    shortest = min(map(len, reference))
    cuts = sorted({0, 1, shortest // 2, shortest - 1})

    def resume_after(cut: int):
        resume = [
            generation_pb2.ResumedSample(index=i, token_ids=tokens(s[:cut])) for i, s in enumerate(reference)
        ]
        return responses(stack.gateways[0], CASES[case], resume)

    with ThreadPoolExecutor(len(cuts)) as pool:
        resumed_after = list(pool.map(resume_after, cuts))
    for cut, resumed in zip(cuts, resumed_after, strict=True):
        for index, (full, rest) in enumerate(zip(reference, resumed, strict=True)):
            where = f"sample {index} resumed after {cut} tokens"
            assert tokens(full[:cut]) + tokens(rest) == tokens(full), where
            assert text(full[:cut]) + text(rest) == text(full), where
            assert [r.text for r in rest] == [r.text for r in full[cut:]], f"{where}: the same deltas"
            last, expected = rest[-1], full[-1]
            assert (last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens) == (
                expected.finish_reason, expected.usage.prompt_tokens, expected.usage.completion_tokens
            ), where  # fmt: skip
            for got, want in zip(logprobs(rest), logprobs(full[cut:]), strict=True):
                assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-3)
    stack.wait_released()


def test_a_resumed_sample_marked_finished_is_not_generated_again(stack, references):
    reference = references["n=2 seeded"]
    resume = [
        generation_pb2.ResumedSample(index=0, token_ids=tokens(reference[0]), finished=True),
        generation_pb2.ResumedSample(index=1, token_ids=tokens(reference[1][:3])),
    ]
    done, rest = responses(stack.gateways[0], CASES["n=2 seeded"], resume)
    assert done == [] and tokens(rest) == tokens(reference[1][3:])
    assert rest[-1].usage.completion_tokens == len(tokens(reference[1]))


def stream_all(targets: list[str], cases: list[str], received: list[int]) -> list[list]:
    """Streams every case at once through one Client of `targets`; `received[i]` counts case i's tokens so
    far. Returns each case's chunks."""

    def run(i: int) -> list:
        chunks = []
        for chunk in client.stream(**CASES[cases[i]]):
            chunks.append(chunk)
            received[i] += len(chunk.token_ids)
        return chunks

    with Client(targets, timeout=WAIT_S * 2) as client, ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(run, range(len(cases))))


def stream_all_async(targets: list[str], cases: list[str], received: list[int]) -> list[list]:
    """stream_all through one AsyncClient, every case a task of one event loop."""

    async def run(client: AsyncClient, i: int) -> list:
        chunks = []
        async for chunk in client.stream(**CASES[cases[i]]):
            chunks.append(chunk)
            received[i] += len(chunk.token_ids)
        return chunks

    async def main() -> list[list]:
        async with AsyncClient(targets, timeout=WAIT_S * 2) as client:
            return list(await asyncio.gather(*(run(client, i) for i in range(len(cases)))))

    return asyncio.run(main())


def wait_streaming(received: list[int], at_least: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while min(received) < at_least:
        assert time.monotonic() < deadline, f"not every stream got {at_least} tokens: {received}"
        time.sleep(0.02)


def assert_like_reference(chunks_by_case: list[list], cases: list[str], references) -> None:
    for name, chunks in zip(cases, chunks_by_case, strict=True):
        for index, full in enumerate(references[name]):
            mine = [c for c in chunks if c.index == index]
            assert [t for c in mine for t in c.token_ids] == tokens(full), f"{name}, sample {index}"
            assert "".join(c.text for c in mine) == text(full), f"{name}, sample {index}: text"
            assert mine[-1].finish_reason == {1: "length", 2: "stop"}[full[-1].finish_reason]
            assert mine[-1].usage.completion_tokens == full[-1].usage.completion_tokens
            assert mine[-1].usage.prompt_tokens == full[-1].usage.prompt_tokens


@pytest.mark.parametrize("stop_how", ["kill -9", "drain"])
def test_streams_resume_on_the_other_gateway_when_theirs_stops(stack, references, stop_how):
    """kill -9 (Client): the streams break at once; drain (SIGTERM, --drain-timeout 1; AsyncClient): they
    are cut a second later. Compute is stopped meanwhile, so no stream ends before its gateway is gone: each
    resumes once on the other gateway and ends as the fault-free run."""
    first, second = stack.gateways
    if stop_how == "drain":
        stop(first.proc)
        first.start("--drain-timeout", "1")
    cases = list(CASES)
    received = [0] * len(cases)
    streaming = stream_all if stop_how == "kill -9" else stream_all_async
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(streaming, [first.target, second.target], cases, received)
        wait_streaming(received, 3)
        with stopped(stack.compute.pid):
            first.proc.send_signal(signal.SIGKILL if stop_how == "kill -9" else signal.SIGTERM)
            assert first.proc.wait(30) in (-signal.SIGKILL, 0)
        chunks_by_case = running.result(WAIT_S * 3)
    assert_like_reference(chunks_by_case, cases, references)
    assert [chunks[-1].resumes for chunks in chunks_by_case] == [1] * len(cases)
    stack.wait_released()
    first.start()


def test_a_resume_takes_over_the_running_request_of_its_id(stack, references):
    gateway, reference = stack.gateways[0], references["greedy"][0]
    request = build_request(**{**CASES["greedy"], "max_tokens": 400}, request_id="taken-over")
    with grpc.insecure_channel(gateway.target) as chan:
        stub = generation_pb2_grpc.GenerationStub(chan)
        old = stub.Generate(request, timeout=WAIT_S)
        got = [t for _, reply in zip(range(4), old, strict=False) for t in reply.token_ids]
        request.resume.add(index=0, token_ids=got)
        request.sampling.max_tokens = CASES["greedy"]["max_tokens"]
        new = list(stub.Generate(request, timeout=WAIT_S))
        with pytest.raises(grpc.RpcError) as ended:
            list(old)
    assert ended.value.code() == grpc.StatusCode.ABORTED
    assert "request taken-over was resumed by another call" in ended.value.details()
    assert got + tokens(new) == tokens(reference)
    stack.wait_released()


def test_a_resume_that_is_no_stream_of_the_request_is_refused(stack):
    request = build_request(**CASES["greedy"], request_id="bad-resume")
    request.resume.add(index=1, token_ids=[5])
    with grpc.insecure_channel(stack.gateways[0].target) as chan, pytest.raises(grpc.RpcError) as refused:
        list(generation_pb2_grpc.GenerationStub(chan).Generate(request, timeout=WAIT_S))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resume[0].index is 1: the request has samples 0..0" in refused.value.details()
    assert stack.cache.stats().used_blocks == 0


def test_the_openai_api_resumes_through_its_extension_fields(stack):
    """A chat stream with return_token_ids, closed after 5 chunks, resumed with resume and the same
    X-Request-Id: its text and token ids go on as the whole response's; no second role; the usage counts
    all 40 tokens. Without the id, a resume is a 400 naming resume."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me about the lighthouse"}],
            "max_tokens": 40, "temperature": 0.0}  # fmt: skip
    extra = {"ignore_eos": True, "return_token_ids": True}
    same_id = {"extra_headers": {"X-Request-Id": "http-resume"}}
    with openai.OpenAI(base_url=stack.http_url, api_key="-", max_retries=0, timeout=WAIT_S) as api:
        whole = api.chat.completions.create(**body, extra_body=extra)
        stream = api.chat.completions.create(**body, extra_body=extra, stream=True, **same_id)
        first = [next(stream).choices[0] for _ in range(5)]
        stream.close()
        received = [t for choice in first for t in choice.model_extra["token_ids"]]
        resume = {**extra, "resume": [{"index": 0, "token_ids": received}]}
        rest = list(api.chat.completions.create(**body, extra_body=resume, stream=True, **same_id,
                                                stream_options={"include_usage": True}))  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(**body, extra_body=resume)
    choices = [chunk.choices[0] for chunk in rest if chunk.choices]
    assert (
        received + [t for c in choices for t in c.model_extra["token_ids"]]
        == whole.choices[0].model_extra["token_ids"]
    )
    text_of = lambda choices: "".join(c.delta.content or "" for c in choices)  # noqa: E731
    assert text_of(first) + text_of(choices) == whole.choices[0].message.content
    assert first[0].delta.role == "assistant" and all(c.delta.role is None for c in choices)
    assert rest[-1].usage.completion_tokens == 40 and choices[-1].finish_reason == "length"
    assert refused.value.body["param"] == "resume"
    stack.wait_released()


def test_pagedserve_generate_moves_past_a_gateway_that_is_down(stack, references):
    down = f"127.0.0.1:{free_port()}"
    argv = [*PAGEDSERVE, "generate", CASES["greedy"]["prompt"], "--max-tokens", "40", "--temperature", "0",
            "--ignore-eos", "--target", down, "--target", stack.gateways[1].target]  # fmt: skip
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout == text(references["greedy"][0]) + "\n"
    assert f"on {down}: UNAVAILABLE" in out.stderr, "the SDK says it moved on"
