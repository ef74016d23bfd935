"""The OpenAI-compatible HTTP front's pure parts: OpenAI JSON translated into GenerateRequests (each
parameter, each refusal), gateway errors mapped to HTTP statuses and OpenAI's error JSON, and the streamed
chunks' format."""

import asyncio
import json
import socket
import urllib.request

import grpc
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2

from common import errors
from gateway.generation import CallEnd
from gateway.http.app import create_app
from gateway.http.errors import from_gateway, internal
from gateway.http.openai_api import Front, _events, openai_api
from gateway.http.openai_request import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    parse,
)
from gateway.http.openai_response import DONE, Rendering, event
from gateway.http.serve import HttpServer
from gateway.sampling import resolve_sampling
from protos import generation_pb2
from tests.helpers import free_port

MAX_MODEL_LEN = 2048


def completion(**body) -> generation_pb2.GenerateRequest:
    return completion_request(parse(CompletionRequest, {"prompt": "Hi", **body}), "rid")


def chat(**body) -> generation_pb2.GenerateRequest:
    messages = body.pop("messages", [{"role": "user", "content": "Hi"}])
    return chat_request(parse(ChatRequest, {"messages": messages, **body}), "rid", MAX_MODEL_LEN)


def refusal(call, **body) -> dict:
    with pytest.raises(Exception) as caught:
        call(**body)
    err = caught.value
    assert err.status == 400 and err.kind == "invalid_request_error", err
    return err.body()["error"]


# translation
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"temperature": 0.5}, {"temperature": 0.5}),
        ({"top_p": 0.9}, {"top_p": pytest.approx(0.9)}),
        ({"max_tokens": 7}, {"max_tokens": 7}),
        ({"n": 3}, {"n": 3}),
        ({"seed": 2**64 - 1}, {"seed": 2**64 - 1}),
        ({"presence_penalty": 0.5}, {"presence_penalty": 0.5}),
        ({"frequency_penalty": -0.5}, {"frequency_penalty": -0.5}),
        ({"logit_bias": {"5": -100, "7": 2.5}}, {"logit_bias": {5: -100.0, 7: 2.5}}),
        ({"stop": "\n"}, {"stop": ["\n"]}),
        ({"stop": ["a", "bc"]}, {"stop": ["a", "bc"]}),
        ({"logprobs": 3}, {"logprobs": 3}),
        ({"logprobs": 0}, {"logprobs": 0}),
        ({"top_k": 40}, {"top_k": 40}),
        ({"top_k": -1}, {"top_k": 0}),
        ({"min_p": 0.25}, {"min_p": 0.25}),
        ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
        ({"min_tokens": 4}, {"min_tokens": 4}),
        ({"ignore_eos": True}, {"ignore_eos": True}),
        ({"stop_token_ids": [2, 3]}, {"stop_token_ids": [2, 3]}),
    ],
)
def test_each_completions_parameter_becomes_its_sampling_field(body, expected):
    sampling = completion(**body).sampling
    for name, value in expected.items():
        got = getattr(sampling, name)
        assert (
            dict(got) if name == "logit_bias" else list(got) if name in ("stop", "stop_token_ids") else got
        ) == value


def test_unset_parameters_stay_unset_so_the_gateway_fills_its_defaults():
    request = completion()
    assert request.prompt == "Hi" and request.request_id == "rid"
    assert request.sampling == generation_pb2.SamplingParams()
    resolved = resolve_sampling(request.sampling, 100)
    assert resolved.max_tokens == 16 and resolved.temperature == 1.0 and resolved.logprobs is None


def test_a_token_id_prompt_cache_salt_and_priority_pass_through():
    request = completion(prompt=[5, 6, 7], cache_salt="s", priority=-2, user="someone")
    assert list(request.token_ids) == [5, 6, 7] and not request.prompt
    assert request.cache_salt == "s" and request.priority == -2


def test_chat_messages_take_a_string_or_text_parts():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}]
    request = chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}])
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."),
        ("user", "Hello, there"),
    ]


def test_chat_runs_to_the_context_unless_bounded_and_asks_logprobs_with_top_logprobs():
    assert chat().sampling.max_tokens == MAX_MODEL_LEN
    assert chat(max_tokens=5).sampling.max_tokens == 5
    assert chat(max_completion_tokens=6).sampling.max_tokens == 6
    assert not chat().sampling.HasField("logprobs")
    assert chat(logprobs=True).sampling.logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).sampling.logprobs == 4


# refusals
@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": []}, "tools", "unsupported parameter 'tools'"),
        ({"suffix": "end"}, "suffix", "suffix is not supported"),
        ({"best_of": 3, "n": 2}, "best_of", "best_of is not supported"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
        ({"temperature": "1"}, "temperature", "valid number"),
        ({"max_tokens": 1.0}, "max_tokens", "valid integer"),
        ({"n": True}, "n", "valid integer"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"max_tokens": 2**31}, "max_tokens", "less than or equal to"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias keys are token ids"),
        ({"prompt": [1, "a"]}, "prompt", "prompt must be a string, a list of token ids"),
        ({"prompt": [["a"]]}, "prompt", "or a list of strings or of token-id lists"),
        ({"prompt": []}, "prompt", "prompt is an empty list"),
        ({"prompt": ["a", ""]}, "prompt", "prompt[1] is empty"),
        ({"prompt": [[]]}, "prompt", "prompt is empty"),
        ({"prompt_logprobs": "1"}, "prompt_logprobs", "valid integer"),
    ],
)
def test_completions_refuse_what_they_cannot_serve_naming_the_parameter(body, param, says):
    error = refusal(completion, **body)
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"max_tokens": 2, "max_completion_tokens": 3}, "max_tokens", "not both"),
        ({"functions": []}, "functions", "unsupported parameter"),
        ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages", "'messages[0].audio'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "messages",
            "'input_audio' found using 'type' does not match any of the expected tags: 'text', 'image_url'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].image_url.url",
            "a URL without a scheme is not accepted: send a data: URL",
        ),
    ],
)
def test_chat_refuses_what_it_cannot_serve_naming_the_parameter(body, param, says):
    error = refusal(chat, **body)
    assert error["param"] == param and says in error["message"], error


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(Exception) as caught:
        parse(CompletionRequest, [1, 2])
    assert caught.value.status == 400 and "JSON object" in caught.value.message


# errors
@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (errors.InvalidArgument, 400, "invalid_request_error"),
        (errors.Unauthenticated, 401, "authentication_error"),
        (errors.NotFound, 404, "not_found_error"),
        (errors.ResourceExhausted, 429, "rate_limit_error"),
        (errors.Unavailable, 503, "service_unavailable_error"),
        (errors.FailedPrecondition, 500, "server_error"),
        (errors.Cancelled, 500, "server_error"),
    ],
)
def test_gateway_errors_map_to_their_http_status_and_openai_type(error, status, kind):
    refusal = from_gateway(error("what to fix"))
    assert (refusal.status, refusal.kind) == (status, kind)
    assert refusal.body() == {
        "error": {"message": "what to fix", "type": kind, "param": None, "code": error.code.name.lower()}
    }


def test_permission_denied_is_403():
    class Denied(errors.PagedServeError):
        code = grpc.StatusCode.PERMISSION_DENIED

    assert from_gateway(Denied("no")).status == 403


def test_the_param_is_the_field_the_gateway_message_names_under_its_openai_name():
    message = "sampling.logprobs must be in [0, 20] (top alternatives per token), got 21"
    assert from_gateway(errors.InvalidArgument(message)).param == "logprobs"
    assert from_gateway(errors.InvalidArgument(message), {"logprobs": "top_logprobs"}).param == "top_logprobs"
    prompt = errors.InvalidArgument("prompt has 9000 tokens; the model takes at most 8191")
    assert from_gateway(prompt).param == "prompt"
    assert from_gateway(prompt, {"prompt": "messages"}).param == "messages"
    assert from_gateway(errors.InvalidArgument("token id 99999 is outside the vocabulary")).param == "prompt"
    assert from_gateway(errors.InvalidArgument("the gateway says no")).param is None


def test_an_unexpected_failure_is_a_500_server_error():
    err = internal(ValueError("boom"))
    assert err.status == 500 and err.body()["error"]["type"] == "server_error" and "boom" in err.message


# chunks
class Tokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def reply(index=0, text="", tokens=(1,), finish=0, logprobs=None, usage=None):
    r = generation_pb2.GenerateResponse(
        request_id="rid", index=index, text=text, token_ids=tokens, finish_reason=finish, logprobs=logprobs
    )
    if usage:
        r.usage.CopyFrom(generation_pb2.Usage(**usage))
    return r


STOP, LENGTH = generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH
USAGE = {"prompt_tokens": 5, "cached_tokens": 3, "completion_tokens": 2}


def test_an_event_is_one_data_line_of_json_and_the_stream_ends_with_done():
    text = event({"a": "é"})
    assert text == 'data: {"a":"é"}\n\n' and json.loads(text.removeprefix("data: ")) == {"a": "é"}
    assert DONE == "data: [DONE]\n\n"


def test_completion_chunks_carry_text_and_the_finish_reason_in_openai_format():
    rendering = Rendering(False, "m", Tokenizer())
    chunk = rendering.chunk(reply(text="Hel"), with_usage=False)
    assert chunk == {
        "id": "cmpl-rid",
        "object": "text_completion",
        "created": rendering.created,
        "model": "m",
        "choices": [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None}],
    }
    assert rendering.chunk(reply(text=""), with_usage=False) is None, "held back text: nothing to tell"
    last = rendering.chunk(reply(text="lo", finish=STOP, usage=USAGE), with_usage=True)
    assert last["choices"][0]["finish_reason"] == "stop" and last["usage"] is None
    final = rendering.usage_chunk()
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_chat_chunks_open_each_choice_with_the_assistant_role():
    rendering = Rendering(True, "m", Tokenizer())
    first = rendering.chunk(reply(index=1, text=""), with_usage=False)
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-rid"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    later = rendering.chunk(reply(index=1, text="hi", finish=LENGTH, usage=USAGE), with_usage=False)
    assert later["choices"][0] == {
        "index": 1,
        "delta": {"content": "hi"},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert "usage" not in later


def logprob(token, value, *top):
    return generation_pb2.TokenLogprobs(
        token_id=token, logprob=value, top_token_ids=[t for t, _ in top], top_logprobs=[p for _, p in top]
    )


def test_whole_responses_join_each_sample_and_sum_their_completion_tokens():
    replies = [
        reply(0, "a", logprobs=[logprob(1, -0.5, (1, -0.5), (2, -1.5))]),
        reply(1, "x", logprobs=[logprob(3, -0.25, (3, -0.25), (1, -2.0))]),
        reply(0, "b", finish=STOP, logprobs=[logprob(22, -1.0, (4, -0.75), (22, -1.0))], usage=USAGE),
        reply(1, "y", finish=LENGTH, logprobs=[logprob(5, -0.5, (5, -0.5), (6, -3.0))], usage=USAGE),
    ]
    whole = Rendering(False, "m", Tokenizer(), n=2).whole(replies, logprobs=True)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "ab", "stop"),
        (1, "xy", "length"),
    ]
    assert whole["usage"]["completion_tokens"] == 4 and whole["usage"]["prompt_tokens"] == 5
    assert whole["choices"][0]["logprobs"] == {
        "tokens": ["<1>", "<22>"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"<1>": -0.5, "<2>": -1.5}, {"<4>": -0.75, "<22>": -1.0}],
        "text_offset": [0, 3],
    }
    chat = Rendering(True, "m", Tokenizer()).whole(replies[:3:2], logprobs=True)
    message = chat["choices"][0]
    assert message["message"] == {"role": "assistant", "content": "ab"}
    assert message["logprobs"]["content"][1] == {
        "token": "<22>",
        "logprob": -1.0,
        "bytes": list(b"<22>"),
        "top_logprobs": [
            {"token": "<4>", "logprob": -0.75, "bytes": list(b"<4>")},
            {"token": "<22>", "logprob": -1.0, "bytes": list(b"<22>")},
        ],
    }


def test_a_call_end_runs_each_callback_once_and_late_ones_at_once():
    end, ran = CallEnd(), []
    end.add(lambda: ran.append("abort"))
    end.end()
    end.end()
    assert ran == ["abort"]
    end.add(lambda: ran.append("late"))
    assert ran == ["abort", "late"]


def test_an_error_after_the_first_chunk_is_an_error_event_then_done():
    async def replies():
        yield reply(text="b")
        raise errors.Unavailable("the gateway shut down before this request finished")

    async def events() -> list[str]:
        rendering = Rendering(False, "m", Tokenizer())
        return [e async for e in _events(reply(text="a"), replies(), rendering, usage=True, renames={})]

    sent = asyncio.run(events())
    assert [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in sent[:2]] == ["a", "b"]
    assert json.loads(sent[2].removeprefix("data: ")) == {
        "error": {
            "message": "the gateway shut down before this request finished",
            "type": "service_unavailable_error",
            "param": None,
            "code": "unavailable",
        }
    }
    assert sent[3:] == [DONE], "no usage chunk after an error; the stream still ends"


# the server
def test_the_http_server_binds_at_once_serves_and_stops():
    app = create_app([lambda app: app.add_api_route("/ping", lambda: {"pong": True})])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            HttpServer("127.0.0.1", taken.getsockname()[1], None, None)
    server = HttpServer("127.0.0.1", free_port(), None, None)
    server.start(app)
    url = f"http://127.0.0.1:{server.port}/ping"
    assert json.load(urllib.request.urlopen(url, timeout=10)) == {"pong": True}
    server.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=10)


def test_an_unknown_path_or_method_under_v1_answers_in_openai_error_json():
    front = Front(bridge=None, health=lambda: health_pb2.HealthCheckResponse.SERVING)
    extra = [lambda app: app.add_api_route("/elsewhere", lambda: {"ok": True})]
    client = TestClient(create_app([openai_api(front), *extra]))
    missing = client.get("/v1/audio/speech")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    assert "GET /v1/audio/speech" in missing.json()["error"]["message"]
    wrong = client.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
    assert client.get("/health").status_code == 200
    # Outside /v1 (the dashboard's paths), FastAPI's own errors stay.
    assert client.get("/nowhere").json() == {"detail": "Not Found"}
