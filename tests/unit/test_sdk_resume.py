"""The SDK's side of resuming (sdk.resume): a stream that breaks with UNAVAILABLE is sent again with what
was received, to the next gateway (or the same one), and the caller sees one stream; other errors, and
breaks past the resume timeout, are raised. Against in-process gRPC gateways that follow the resume
contract with a deterministic generator (token = 1000 * sample + position) and break where told."""

import asyncio
import threading
from concurrent import futures

import grpc
import pytest

from protos import generation_pb2, generation_pb2_grpc
from sdk.client import AsyncClient, Client, GenerationError
from tests.helpers import free_port

PROMPT = [5, 6, 7]


def token(index: int, position: int) -> int:
    return 1000 * index + position


class ScriptedGateway(generation_pb2_grpc.GenerationServicer):
    """Call k sends `breaks[k]` responses, then ends with `codes[k]` (UNAVAILABLE by default); calls past the
    script run to the end. Every request is kept."""

    def __init__(self, breaks: list[int], codes: list[grpc.StatusCode] | None = None) -> None:
        self.breaks, self.codes = list(breaks), list(codes or [])
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.requests.append(request)
            budget = self.breaks.pop(0) if self.breaks else None
            code = self.codes.pop(0) if self.codes else grpc.StatusCode.UNAVAILABLE
        n, max_tokens = request.sampling.n or 1, request.sampling.max_tokens
        done = {r.index for r in request.resume if r.finished}
        had = {r.index: len(r.token_ids) for r in request.resume}
        # one token per response, samples interleaved, as the gateway's steps do
        order = [(i, p) for p in range(max_tokens) for i in range(n) if i not in done and p >= had.get(i, 0)]
        for sent, (index, position) in enumerate(order):
            if budget is not None and sent == budget:
                context.abort(code, "the gateway went away")
            reply = generation_pb2.GenerateResponse(
                request_id=request.request_id or "made-by-the-gateway",
                token_ids=[token(index, position)],
                text=f"<{position}>",
                index=index,
            )
            if position == max_tokens - 1:
                reply.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                reply.usage.completion_tokens = max_tokens
            yield reply


def serve(gateway: ScriptedGateway) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    generation_pb2_grpc.add_GenerationServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def gateways(request):
    """Scripted gateways serving, by their scripts (the test's parameter): [(gateway, target)]."""
    started = [(gateway, *serve(gateway)) for gateway in request.param]
    yield [(gateway, target) for gateway, _, target in started]
    for _, server, _ in started:
        server.stop(0)


@pytest.mark.parametrize("gateways", [[ScriptedGateway([3, 2])]], indirect=True)
def test_a_broken_stream_resumes_on_its_gateway_with_what_it_received(gateways):
    ((gateway, target),) = gateways
    with Client(target, timeout=30) as client:
        chunks = list(client.stream(token_ids=PROMPT, max_tokens=8, request_id="abc"))
    assert [t for c in chunks for t in c.token_ids] == [token(0, p) for p in range(8)]
    assert "".join(c.text for c in chunks) == "".join(f"<{p}>" for p in range(8))
    assert [c.resumes for c in chunks] == [0, 0, 0, 1, 1, 2, 2, 2]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 8
    first, second, third = gateway.requests
    assert {r.request_id for r in gateway.requests} == {"abc"}, "one request id: the gateway takes it over"
    assert list(first.resume) == []
    assert [(r.index, list(r.token_ids), r.finished) for r in second.resume] == [(0, [0, 1, 2], False)]
    assert [list(r.token_ids) for r in third.resume] == [[0, 1, 2, 3, 4]]
    assert second.token_ids == first.token_ids and second.sampling == first.sampling


@pytest.mark.parametrize("gateways", [[ScriptedGateway([4]), ScriptedGateway([])]], indirect=True)
def test_n_samples_resume_on_the_other_gateway_with_the_finished_ones_marked(gateways):
    (dying, first_target), (other, second_target) = gateways
    with Client([first_target, second_target], timeout=30) as client:
        samples = client.generate_n(token_ids=PROMPT, n=2, max_tokens=3)
        again = client.generate(token_ids=PROMPT, max_tokens=2)
    assert [s.token_ids for s in samples] == [[token(i, p) for p in range(3)] for i in range(2)]
    assert [s.resumes for s in samples] == [1, 1]
    (resumed, later) = other.requests
    assert [(r.index, list(r.token_ids), r.finished) for r in resumed.resume] == [
        (0, [0, 1], False),
        (1, [1000, 1001], False),
    ]
    assert again.token_ids == [0, 1] and not later.resume, "later requests go to the gateway that answered"
    assert len(dying.requests) == 1 and dying.requests[0].request_id == ""
    assert resumed.request_id == "made-by-the-gateway", "a resume names the id the gateway answered with"


@pytest.mark.parametrize("gateways", [[ScriptedGateway([])]], indirect=True)
def test_a_gateway_not_yet_listening_is_waited_for_and_another_tried(gateways):
    ((gateway, target),) = gateways
    closed = f"127.0.0.1:{free_port()}"
    with Client([closed, target], timeout=30) as client:
        assert client.generate(token_ids=PROMPT, max_tokens=2).token_ids == [0, 1]
    assert len(gateway.requests) == 1


@pytest.mark.parametrize(
    "gateways", [[ScriptedGateway([2], [grpc.StatusCode.INVALID_ARGUMENT])]], indirect=True
)
def test_an_error_of_the_request_is_raised_not_resumed(gateways):
    ((gateway, target),) = gateways
    with Client(target, timeout=30) as client, pytest.raises(GenerationError) as raised:
        client.generate(token_ids=PROMPT, max_tokens=5)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT and len(gateway.requests) == 1


@pytest.mark.parametrize("gateways", [[ScriptedGateway([2])]], indirect=True)
def test_resume_timeout_zero_raises_the_break(gateways):
    ((gateway, target),) = gateways
    with Client(target, timeout=30, resume_timeout=0) as client, pytest.raises(GenerationError) as raised:
        client.generate(token_ids=PROMPT, max_tokens=5)
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE and len(gateway.requests) == 1


def test_a_gateway_that_stays_away_ends_the_request_after_the_resume_timeout():
    closed = f"127.0.0.1:{free_port()}"
    with Client(closed, resume_timeout=1.0) as client, pytest.raises(GenerationError) as raised:
        client.generate(token_ids=PROMPT, max_tokens=5)
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    with Client(closed, timeout=1.0) as client, pytest.raises(GenerationError) as timed_out:
        client.generate(token_ids=PROMPT, max_tokens=5)
    assert timed_out.value.code == grpc.StatusCode.UNAVAILABLE, "the break, not that the timeout passed"
    assert "failed to connect" in timed_out.value.details


@pytest.mark.parametrize("gateways", [[ScriptedGateway([1, 0]), ScriptedGateway([2])]], indirect=True)
def test_the_async_client_resumes_alike(gateways):
    (first, first_target), (second, second_target) = gateways

    async def run() -> list:
        async with AsyncClient([first_target, second_target], timeout=30) as client:
            return [chunk async for chunk in client.stream(token_ids=PROMPT, max_tokens=6)]

    chunks = asyncio.run(run())
    assert [t for c in chunks for t in c.token_ids] == [token(0, p) for p in range(6)]
    assert [c.resumes for c in chunks] == [0, 1, 1, 2, 2, 2]
    assert [len(r.resume and r.resume[0].token_ids) for r in first.requests] == [0, 3]
    assert [len(r.resume and r.resume[0].token_ids) for r in second.requests] == [1, 3]
