"""The OpenAI-compatible HTTP API against the real stack (the session's float32 stack of the real model):
the official `openai` client and the system's curl.

Greedy text equals the gRPC API's for the same prompt, streamed or not; n samples, logprobs and
cached_tokens as the gRPC API gives them; errors in OpenAI's JSON with their HTTP status; a client that
disconnects mid-request has its sequence aborted and its blocks freed. API keys and TLS over HTTP are in
test_edge.py.
"""

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid

import openai
import pytest

from cli.processes import services_of
from tests.e2e.stack import start_stack
from tests.processes import stopped
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e
CURL = shutil.which("curl")
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0.0, "max_tokens": 16}
# Over two 16-token blocks, so that a repeat reuses whole blocks.
LONG_PROMPT = "In a small village by the sea, an old fisherman told the children a story every evening. " * 2


@pytest.fixture(scope="module")
def grpc(stack_fp32):
    with stack_fp32.client(timeout=120) as client:
        yield client


def salt() -> dict:
    """A fresh prefix-cache namespace (vLLM's cache_salt), so that no other test's prompt is reused."""
    return {"extra_body": {"cache_salt": uuid.uuid4().hex}}


def curl(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CURL, "-sS", *args, url], capture_output=True, text=True, timeout=120)


def test_models_and_health(stack_fp32, api, grpc, model):
    info = grpc.info()
    assert model == info.model
    assert api.models.retrieve(model).id == model
    health = urllib.request.urlopen(stack_fp32.http_url.removesuffix("/v1") + "/health", timeout=10)
    assert health.status == 200 and json.load(health) == {"status": "serving"}


def test_greedy_completions_equal_the_grpc_api_streamed_or_not(api, grpc, model):
    expected = grpc.generate(prompt=PROMPT, **GREEDY)
    whole = api.completions.create(
        model=model, prompt=PROMPT, extra_headers={"x-request-id": "http-1"}, **GREEDY
    )
    assert whole.id == "cmpl-http-1", "the caller's x-request-id names the request"
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == expected.finish_reason
    assert whole.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.prompt_tokens == expected.usage.prompt_tokens
    chunks = list(api.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == expected.finish_reason
    assert all(c.id == chunks[0].id for c in chunks)


def test_greedy_chat_equals_the_grpc_api_streamed_or_not(api, grpc, model):
    expected = grpc.generate(messages=CHAT, **GREEDY)
    whole = api.chat.completions.create(model=model, messages=CHAT, **GREEDY)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].message.role == "assistant"
    chunks = list(
        api.chat.completions.create(
            model=model, messages=CHAT, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_n_samples_seeded_like_the_grpc_api(api, grpc, model):
    params = {"temperature": 0.9, "max_tokens": 12, "seed": 7}
    expected = grpc.generate_n(prompt=PROMPT, n=3, **params)
    whole = api.completions.create(model=model, prompt=PROMPT, n=3, **params)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [e.text for e in expected]
    assert whole.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    streamed = {}
    for chunk in api.completions.create(model=model, prompt=PROMPT, n=3, stream=True, **params):
        streamed[chunk.choices[0].index] = streamed.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert [streamed[i] for i in range(3)] == [e.text for e in expected]


def test_logprobs_are_the_grpc_api_ones(api, grpc, model, tokenizer):
    expected = grpc.generate(prompt=PROMPT, logprobs=2, **GREEDY)
    whole = api.completions.create(model=model, prompt=PROMPT, logprobs=2, **GREEDY).choices[0].logprobs
    assert whole.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs])
    assert whole.tokens == [tokenizer.decode([lp.token_id]) for lp in expected.logprobs]
    assert [len(top) for top in whole.top_logprobs] == [2] * len(expected.logprobs)
    chat = api.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    assert all(
        len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob for entry in content
    )


def test_a_repeated_prompt_reports_its_cached_tokens(api, model):
    namespace = salt()
    first = api.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2, **namespace)
    again = api.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2, **namespace)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def bad_request(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    assert caught.value.status_code == 400 and caught.value.type == "invalid_request_error"
    return caught.value


def test_bad_parameters_are_400_naming_the_parameter(api, model):
    err = bad_request(lambda: api.completions.create(model=model, prompt=PROMPT, temperature=-1))
    assert err.param == "temperature" and "temperature must be >= 0" in err.message
    err = bad_request(
        lambda: api.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=21)
    )
    assert err.param == "top_logprobs"
    functions = [{"name": "f", "parameters": {}}]
    err = bad_request(lambda: api.chat.completions.create(model=model, messages=CHAT, functions=functions))
    assert err.param == "functions" and "unsupported parameter" in err.message
    err = bad_request(lambda: api.completions.create(model=model, prompt=PROMPT, suffix="and so on"))
    assert err.param == "suffix"
    hacker = [{"role": "hacker", "content": "Name three colours."}]
    err = bad_request(lambda: api.chat.completions.create(model=model, messages=hacker))
    assert "messages[0] has role 'hacker': use one of system, developer, user, assistant, tool" in err.message


def test_a_request_id_with_control_characters_is_one_cleaned_id_in_header_and_body(stack_fp32):
    """HTTP clients refuse to send such a header: it goes out on a raw socket."""
    host, port = stack_fp32.http_url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode()  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=120) as conn:
        conn.sendall(head + b"X-Request-Id: ab\x01c\x7fd\tz\xc3\xa9\r\n\r\n" + body)
        reply = b"".join(iter(lambda: conn.recv(65536), b""))
    headers, _, payload = reply.partition(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.1 200"), reply
    (echoed,) = [line.split(b":", 1)[1].strip() for line in headers.split(b"\r\n")[1:]
                 if line.lower().startswith(b"x-request-id:")]  # fmt: skip
    assert echoed == rb"ab\x01c\x7fd\x09z\xc3\xa9"
    assert json.loads(payload)["id"] == "cmpl-" + echoed.decode()


def test_an_unknown_model_is_404(api):
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
    assert caught.value.code == "model_not_found" and "GET /v1/models" in caught.value.message


def test_an_oversize_prompt_is_413(api, model):
    with pytest.raises(openai.APIStatusError) as caught:
        api.completions.create(model=model, prompt="x" * 9 * 2**20, max_tokens=1)
    assert caught.value.status_code == 413 and caught.value.code == "request_too_large"


def test_an_oversize_or_malformed_body_is_refused_before_it_is_parsed(stack_fp32):
    url = stack_fp32.http_url + "/completions"
    oversize = curl(url, "-H", "Content-Type: application/json", "-H", "Content-Length: 9000000", "-d", "{}")
    assert '"code":"request_too_large"' in oversize.stdout and "--max-request-bytes" in oversize.stdout
    status = curl(url, "-o", "/dev/null", "-w", "%{http_code}", "-H", "Content-Length: 9000000", "-d", "{}")
    assert status.stdout == "413"
    chunked = subprocess.run(
        [CURL, "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-H", "Transfer-Encoding: chunked",
         "--data-binary", "@-", url],
        input="x" * 9 * 2**20, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert chunked.stdout == "413", "a body of unknown length is cut at the limit too"
    malformed = curl(url, "-w", "\n%{http_code}", "-H", "Content-Type: application/json", "-d", '{"prompt": ')
    body, code = malformed.stdout.rsplit("\n", 1)
    assert code == "400" and json.loads(body)["error"]["message"].startswith(
        "the request body is not valid JSON"
    )


@pytest.mark.skipif(CURL is None, reason="needs the system's curl")
def test_curl_streams_server_sent_events_ending_in_done(stack_fp32, grpc):
    expected = grpc.generate(prompt=PROMPT, **GREEDY)
    body = json.dumps({"prompt": PROMPT, "stream": True, **GREEDY})
    out = curl(stack_fp32.http_url + "/completions", "-N", "-H", "Content-Type: application/json", "-d", body)
    events = [line for line in out.stdout.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in events), out.stdout
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert {c["object"] for c in chunks} == {"text_completion"}


def used_blocks_after(stack, deadline_s: float) -> int:
    deadline = time.monotonic() + deadline_s
    while (used := stack.stats().used_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    return used


@pytest.mark.skipif(CURL is None, reason="needs the system's curl")
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_mid_request_frees_its_blocks(stack_fp32, stream):
    assert used_blocks_after(stack_fp32, 10) == 0
    body = json.dumps({"prompt": LONG_PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": stream})
    argv = [
        CURL,
        "-sN",
        stack_fp32.http_url + "/completions",
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
    ]
    client = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        if stream:
            assert client.stdout.readline().startswith("data: ")
        deadline = time.monotonic() + 30
        while stack_fp32.stats().used_blocks == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.05)
    finally:
        client.kill()
        client.wait()
    # NOTE: what is asserted is that the blocks come back, not how soon: a loaded machine takes seconds.
    assert used_blocks_after(stack_fp32, 30) == 0


def post(url: str, body: dict, *args: str) -> list[str]:
    """curl's argv posting body as JSON to url."""
    return [CURL, "-sS", *args, url, "-H", "Content-Type: application/json", "-d", json.dumps(body)]


def test_sigterm_drains_http_streams_and_refuses_new_requests(tmp_path, tokenizer, logs):
    """A stack of a random-weight model: SIGTERM while an HTTP stream runs lets it end with [DONE], while
    /health and a new request get 503; then the stack exits 0. Compute is stopped (SIGSTOP) while the probes
    run, so the stream cannot end before them (as in test_supervisor's drain test)."""
    model = save_tiny_llama(tmp_path / "tiny", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(model)
    stack = start_stack(
        logs, "--model", str(model), "--dtype", "float32", "--kv-blocks", "64", "--step-timeout", "120"
    )
    health = stack.http_url.removesuffix("/v1") + "/health"
    compute = services_of(stack.proc.pid)["compute"]
    try:
        body = {"prompt": [5, 6], "max_tokens": 500, "ignore_eos": True, "stream": True}
        client = subprocess.Popen(
            post(stack.http_url + "/completions", body, "-N"), stdout=subprocess.PIPE, text=True
        )
        assert client.stdout.readline().startswith("data: ")
        with stopped(compute):
            stack.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (code := curl(health, "-o", "/dev/null", "-w", "%{http_code}").stdout) == "200":
                assert time.monotonic() < deadline, "health never turned 503"
                time.sleep(0.05)
            assert code == "503", code
            refused = subprocess.run(post(stack.http_url + "/completions", {"prompt": [5], "max_tokens": 1}),
                                     capture_output=True, text=True, timeout=60)  # fmt: skip
            assert json.loads(refused.stdout)["error"]["type"] == "service_unavailable_error", refused
        rest = client.communicate(timeout=60)[0]
        assert rest.endswith('"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'), rest[-300:]
        assert stack.proc.wait(60) == 0
    finally:
        stack.stop()
