"""The structured-output and tool fields of the OpenAI bodies (gateway/http/openai_structured.py): each
constraint spelling (response_format, vLLM's structured_outputs and guided_*) and the tools set on the
GenerateRequest, refusals naming the parameter, and tool calls rendered as OpenAI's message.tool_calls and
streamed delta.tool_calls."""

import json

import pytest

from gateway.http.openai_request import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    parse,
)
from gateway.http.openai_response import Rendering
from protos import generation_pb2

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
NAMED = {"name": "a", "schema": SCHEMA, "strict": True}
TEXT = json.dumps(SCHEMA)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = generation_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')


def chat(**body) -> generation_pb2.GenerateRequest:
    messages = body.pop("messages", [{"role": "user", "content": "Hi"}])
    return chat_request(parse(ChatRequest, {"messages": messages, **body}), "rid", 2048)


def completion(**body) -> generation_pb2.GenerateRequest:
    return completion_request(parse(CompletionRequest, {"prompt": "Hi", **body}), "rid")


@pytest.mark.parametrize(
    ("body", "field", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"response_format": {"type": "json_schema", "json_schema": NAMED}}, "json_schema", TEXT),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", ["a", "b"]),
        ({"structured_outputs": {"grammar": "start: \"x\""}}, "grammar", 'start: "x"'),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
        ({"guided_regex": "a+"}, "regex", "a+"),
        ({"guided_choice": ["x"]}, "choice", ["x"]),
        ({"guided_grammar": "root ::= \"x\""}, "grammar", 'root ::= "x"'),
    ],
)  # fmt: skip
def test_each_constraint_spelling_sets_the_one_constraint(body, field, value):
    for request in (chat(**body), completion(**body)):
        constraint = request.constraint
        assert constraint.WhichOneof("kind") == field
        got = list(constraint.choice.choices) if field == "choice" else getattr(constraint, field)
        assert got == value


def test_a_text_response_format_sets_no_constraint():
    assert not chat(response_format={"type": "text"}).HasField("constraint")


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one constraint"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "Input should be 'text'"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "outputs.structural_tag'"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0].function.name"),
        ({"tool_choice": "always"}, "tool_choice", "tool_choice"),
    ],
)  # fmt: skip
def test_bad_constraints_and_tools_are_refused_naming_the_parameter(body, param, says):
    with pytest.raises(Exception) as caught:
        chat(**body)
    err = caught.value
    assert err.status == 400 and err.param == param and says in err.message, err.message


def test_tools_tool_choice_and_past_calls_reach_the_request():
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    request = chat(
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    assert [t.name for t in request.tools] == ["get_weather"] and json.loads(request.tools[0].parameters) == {
        "type": "object"
    }
    assert request.tool_choice.function == "get_weather" and request.parallel_tool_calls is False
    assert request.messages[1].tool_calls[0].name == "get_weather" and request.messages[1].content == ""
    assert (request.messages[2].role, request.messages[2].tool_call_id) == ("tool", "call_1")
    assert chat(tools=[WEATHER], tool_choice="required").tool_choice.mode == "required"


class Tokenizer:
    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def test_tool_calls_render_as_message_tool_calls_and_streamed_deltas():
    rendering = Rendering(True, "m", Tokenizer())
    last = generation_pb2.GenerateResponse(
        request_id="rid", tool_calls=[CALL], finish_reason=generation_pb2.FINISH_REASON_TOOL_CALLS
    )
    whole = rendering.whole([last], logprobs=False)
    expected = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [expected]}
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    streaming = Rendering(True, "m", Tokenizer())
    streaming.chunk(generation_pb2.GenerateResponse(request_id="rid"), with_usage=False)
    chunks = [streaming.chunk(generation_pb2.GenerateResponse(request_id="rid", tool_calls=[CALL]), False)]
    chunks.append(streaming.chunk(last, with_usage=False))
    deltas = [c["choices"][0]["delta"]["tool_calls"] for c in chunks]
    assert deltas == [[{"index": 0, **expected}], [{"index": 1, **expected}]], "calls numbered in order"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
