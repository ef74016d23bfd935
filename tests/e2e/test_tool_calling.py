"""Tool calling through the official `openai` client and the SDK against the real stack (the session's float32
stack of SmolLM2, whose chat template renders no tools: they go into the system prompt in Hermes's format):
each tool_choice, streamed and not, a round trip (call, `role: tool` result, answer), refusals."""

import json

import openai
import pytest

pytestmark = pytest.mark.e2e
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time now", "parameters": {}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def weather_calls(calls) -> list[dict]:
    assert calls, "the model was made to call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
    return [json.loads(call.function.arguments) for call in calls]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_follows_the_function_schema(api, model, choice):
    done = api.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=False,
        max_tokens=80, temperature=1.0, seed=3,
    )  # fmt: skip
    choice_ = done.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    if choice == NAMED:
        (arguments,) = weather_calls(choice_.message.tool_calls)
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        (call,) = choice_.message.tool_calls
        assert call.function.name in ("get_weather", "get_time") and isinstance(
            json.loads(call.function.arguments), dict
        )


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_calls_stream_as_delta_tool_calls(api, model, choice):
    chunks = list(
        api.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False,
            max_tokens=80, temperature=0, stream=True,
        )
    )  # fmt: skip
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0]
    (arguments,) = weather_calls(deltas)
    assert arguments["city"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()


def test_auto_lets_the_model_answer_or_call_and_none_leaves_the_tools_out(api, model):
    auto = api.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0
    )
    none = api.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=60, temperature=0
    )
    plain = api.chat.completions.create(model=model, messages=ASK, max_tokens=60, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens, "auto puts the tools into the prompt"
    assert (
        none.usage.prompt_tokens == plain.usage.prompt_tokens
        and none.choices[0].message.content == plain.choices[0].message.content
    )
    message = auto.choices[0].message
    if message.tool_calls:
        assert auto.choices[0].finish_reason == "tool_calls"
        weather_calls(message.tool_calls)
    else:
        assert message.content and "<tool_call>" not in message.content


def test_a_round_trip_call_result_answer(api, model):
    messages = list(ASK)
    first = api.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        max_tokens=80, temperature=0,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message)
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "degrees": 21})}
    )
    answer = api.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=60, temperature=0
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    streamed = api.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=60, temperature=0, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == answer.choices[0].message.content
    )


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            {"tools": [{"type": "function", "function": {"description": "nameless"}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "is invalid: use 1 to 64 letters",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "not in tools",
        ),
        ({"tool_choice": "required"}, "'required' needs tools"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "cannot be combined"),
    ],
)
def test_bad_tools_are_refused_with_400(api, model, body, says):
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=model, messages=ASK, max_tokens=20, **body)
    assert says in caught.value.body["message"], caught.value.body


def test_the_sdk_sends_tools_and_gets_the_calls(stack_fp32):
    tool = {"name": "get_weather", "description": "weather", "parameters": WEATHER["function"]["parameters"]}
    with stack_fp32.client(timeout=300) as client:
        done = client.generate(
            messages=ASK, tools=[tool], tool_choice="get_weather", max_tokens=80, temperature=0
        )
        assert done.finish_reason == "tool_calls" and done.text == ""
        (call,) = done.tool_calls
        assert call.name == "get_weather" and json.loads(call.arguments)["city"]
        result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
        messages = [*ASK, {"role": "assistant", "tool_calls": [call]}, result]
        answer = client.generate(messages=messages, tools=[tool], max_tokens=40, temperature=0)
        assert answer.text and answer.finish_reason in ("stop", "length")
