"""Tool calling in the gateway (gateway/tools): the request's tools checked, the Hermes parser splitting a
streamed text into content and calls, the grammar that forces calls (run in the real grammar engine), the
prompt of a chat template that renders no tools (SmolLM2's), and the replies' tool calls and finish reason."""

import json

import pytest
from transformers import AutoTokenizer

from common.errors import InvalidArgument
from common.model_files import local_copy
from gateway import tokenizer as tok
from gateway.structured.grammars import Grammars
from gateway.structured.lark import Tags
from gateway.structured.limits import ConstraintLimits
from gateway.tools import hermes, prompt
from gateway.tools import request as tool_request
from gateway.tools.formats import FORMATS
from gateway.tools.stream import CallStreams
from protos import generation_pb2

WEATHER = generation_pb2.Tool(
    name="get_weather",
    description="The weather of a city",
    parameters=json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ),
)
TIME = generation_pb2.Tool(name="get_time", parameters="")
HERMES = FORMATS["hermes"]
USER = [generation_pb2.ChatMessage(role="user", content="Weather in Paris?")]


def request(**fields) -> generation_pb2.GenerateRequest:
    fields.setdefault("messages", USER)
    fields.setdefault("tools", [WEATHER, TIME])
    return generation_pb2.GenerateRequest(**fields)


def tools_of(**fields) -> tool_request.ToolUse | None:
    return tool_request.from_request(request(**fields), 128, 65536, 32)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(local_copy("smollm2").path)


# requests
def test_tools_default_to_auto_and_parallel_calls():
    use = tools_of()
    assert (use.choice, use.parallel, use.constraint(HERMES, Tags({}))) == ("auto", True, None)
    assert use.tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert tools_of(tool_choice=generation_pb2.ToolChoice(mode="none")) is None


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"tools": [generation_pb2.Tool(description="no name")]}, r"tools\[0\] has no name"),
        ({"tools": [generation_pb2.Tool(name="bad name!")]}, "is invalid: use 1 to 64 letters"),
        ({"tools": [WEATHER, WEATHER]}, "is given twice"),
        (
            {"tools": [generation_pb2.Tool(name="f", parameters="[1]")]},
            r"tools\[0\].parameters must be a JSON object",
        ),
        (
            {"tools": [generation_pb2.Tool(name="f", parameters="{")]},
            r"tools\[0\].parameters is not valid JSON",
        ),
        (
            {"tool_choice": generation_pb2.ToolChoice(function="get_stock")},
            "'get_stock', which is not in tools",
        ),
        ({"tool_choice": generation_pb2.ToolChoice(mode="always")}, "'always' is unknown"),
        ({"messages": [], "prompt": "hi"}, "tools need chat messages"),
        ({"constraint": generation_pb2.Constraint(regex="a")}, "cannot be combined"),
        ({"tools": [], "tool_choice": generation_pb2.ToolChoice(mode="required")}, "'required' needs tools"),
    ],
)
def test_bad_tools_are_refused_naming_the_problem(fields, says):
    with pytest.raises(InvalidArgument, match=says):
        tools_of(**fields)


def test_too_many_tools_or_too_large_schemas_are_refused():
    many = [generation_pb2.Tool(name=f"f{i}") for i in range(3)]
    with pytest.raises(InvalidArgument, match="--max-tools"):
        tool_request.from_request(request(tools=many), 2, 65536, 32)
    with pytest.raises(InvalidArgument, match="--max-constraint-bytes"):
        tool_request.from_request(request(), 128, 20, 32)


# the parser
def test_content_and_calls_split_however_the_text_streams():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nDone'
    for size in (1, 3, 7, len(text)):
        parser, content, calls = hermes.Parser(), "", []
        for start in range(0, len(text), size):
            part, found = parser.feed(text[start : start + size])
            content, calls = content + part, calls + found
        rest, found = parser.finish()
        content, calls = content + rest, calls + found
        assert content == "Sure.\n\nDone" and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ], size
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29


def test_a_call_that_is_not_json_stays_content_and_an_unclosed_whole_one_counts():
    parser = hermes.Parser()
    content, calls = parser.feed("<tool_call>\nnot json\n</tool_call> <tool_")
    assert (content, calls) == ("<tool_call>\nnot json\n</tool_call> ", [])
    content, calls = parser.feed('call>{"name": "get_time"}')
    assert (content, calls) == ("", [])
    content, calls = parser.finish()
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    truncated = hermes.Parser()
    truncated.feed('<tool_call>{"name": "get_ti')
    assert truncated.finish() == ('<tool_call>{"name": "get_ti', [])


def test_replies_carry_the_calls_and_finish_with_tool_calls():
    streams = CallStreams(tools_of(), HERMES)
    first = generation_pb2.GenerateResponse(
        text='<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    streams.apply(first)
    last = generation_pb2.GenerateResponse(
        text='<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        finish_reason=generation_pb2.FINISH_REASON_STOP,
    )
    streams.apply(last)
    assert (first.text, len(first.tool_calls), len(last.tool_calls)) == ("", 1, 1)
    assert last.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS
    single = CallStreams(tools_of(parallel_tool_calls=False), HERMES)
    both = generation_pb2.GenerateResponse(
        text=first.text + last.text, finish_reason=generation_pb2.FINISH_REASON_LENGTH
    )
    both.text = '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_weather"}</tool_call>'
    single.apply(both)
    assert [c.name for c in both.tool_calls] == ["get_time"], "parallel_tool_calls false keeps the first"
    assert both.finish_reason == generation_pb2.FINISH_REASON_LENGTH


def test_a_resumed_sample_goes_on_from_the_text_its_client_received():
    call = '<tool_call>{"name": "get_time"}</tool_call>'
    streams = CallStreams(tools_of(parallel_tool_calls=False), HERMES, {0: call + '<tool_call>{"na'})
    rest = generation_pb2.GenerateResponse(
        text='me": "get_weather"}</tool_call>', finish_reason=generation_pb2.FINISH_REASON_STOP
    )
    streams.apply(rest)
    assert (rest.text, len(rest.tool_calls)) == ("", 0), "the received call was the one call allowed"
    assert rest.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS, "a call was made: before the break"


# forcing calls
@pytest.mark.parametrize(
    ("choice", "parallel"), [("required", True), ("required", False), ("get_weather", True)]
)
def test_forced_calls_follow_the_function_schemas(tokenizer, choice, parallel):
    use = tools_of(
        tool_choice=generation_pb2.ToolChoice(
            **({"mode": choice} if choice == "required" else {"function": choice})
        ),
        parallel_tool_calls=parallel,
    )
    grammars = Grammars(tokenizer, ConstraintLimits())
    spec = use.constraint(HERMES, Tags.of(tokenizer))
    matcher = grammars.matcher(spec, len(tokenizer), [tokenizer.eos_token_id])

    def accepts(text: str) -> bool:
        m = matcher.fresh()
        for token in tokenizer.encode(text, add_special_tokens=False):
            if not (m.mask().view("uint32")[token // 32] >> (token % 32)) & 1:
                return False
            m.accept(token)
        return True

    weather = hermes.call_text("get_weather", {"city": "Paris"})
    assert accepts(weather)
    assert not accepts(hermes.call_text("get_weather", {"town": "Paris"})), "arguments follow the schema"
    assert not accepts("It is sunny"), "a forced call leaves no room for prose"
    assert accepts(hermes.call_text("get_time", {})) == (choice == "required")
    assert accepts(weather + "\n" + weather) == (choice == "required" and parallel)


# the prompt
def test_smollm2s_template_renders_no_tools_so_they_go_into_the_system_prompt(tokenizer):
    assert not prompt.renders_tools(tokenizer)
    messages = [
        *USER,
        generation_pb2.ChatMessage(
            role="assistant",
            tool_calls=[
                generation_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
            ],
        ),
        generation_pb2.ChatMessage(role="tool", tool_call_id="call_1", content='{"sky": "clear"}'),
    ]
    ids = tok.encode(tokenizer, request(messages=messages), len(tokenizer), tools_of())
    text = tokenizer.decode(ids)
    assert '"name": "get_weather"' in text and "<tools>" in text.split("<|im_start|>user")[0], (
        "tools in the system turn"
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"sky": "clear"}\n</tool_response>' in text
    plain = tokenizer.decode(tok.encode(tokenizer, request(messages=USER), len(tokenizer), None))
    assert "<tools>" not in plain


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_given(tokenizer):
    calls = generation_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    messages = [
        generation_pb2.ChatMessage(role="assistant", tool_calls=[calls]),
        generation_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="ok"),
    ]
    conversation, listed = prompt.conversation(messages, tools_of(), native=True)
    assert listed[0]["function"]["name"] == "get_weather"
    assert conversation[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert conversation[1] == {"role": "tool", "content": "ok", "tool_call_id": "call_1"}
