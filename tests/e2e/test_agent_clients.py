"""The clients agents and applications run, against the session's float32 stack of SmolLM2 (whose chat
template renders no tools: the gateway prompts for Hermes's format): the `openai` SDK's Responses API, the
`openai-agents` SDK, the `anthropic` SDK's Messages API, `instructor` and `langchain-openai`. SmolLM2 does not
call tools by itself: the tests force the calls (tool_choice required or named, structured outputs), so
each round trip (call, result fed back, answer) is real; and the refusals of bad input."""

import json

import anthropic
import instructor
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

pytestmark = pytest.mark.e2e
CITY = {"type": "string", "maxLength": 20}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": CITY},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = "What is the weather in Paris right now?"
# The anthropic SDK no longer takes sampling arguments; the Messages API still does.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(stack_fp32):
    with anthropic.Anthropic(
        base_url=stack_fp32.http_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300
    ) as client:
        yield client


# the Responses API
def test_responses_answer_whole_and_streamed_alike(api, model):
    whole = api.responses.create(
        model=model, input=ASK, instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage.output_tokens == 12 and whole.output[0].type == "message"
    events = list(
        api.responses.create(
            model=model, input=ASK, instructions="Be brief.", max_output_tokens=12, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


def test_responses_function_call_round_trip_by_items_and_by_previous_response(api, model):
    first = api.responses.create(
        model=model,
        input=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and call.name == "get_weather" and json.loads(call.arguments)["city"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
    by_items = api.responses.create(
        model=model,
        input=[{"role": "user", "content": ASK}, *first.output, result],
        tools=[WEATHER],
        max_output_tokens=30,
        temperature=0,
    )
    by_previous = api.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=30,
        temperature=0,
    )
    assert by_items.output_text and by_items.output_text == by_previous.output_text
    assert by_previous.usage.input_tokens == by_items.usage.input_tokens > first.usage.input_tokens
    streamed = list(
        api.responses.create(
            model=model,
            input=ASK,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["function_call"] and done[0].arguments == call.arguments
    assert streamed[-1].type == "response.completed"


def test_a_stored_response_is_retrieved_its_input_listed_and_deleted(api, model):
    asked = [{"role": "user", "content": "Hello."}, {"role": "user", "content": ASK}]
    created = api.responses.create(model=model, input=asked, max_output_tokens=5, temperature=0)
    retrieved = api.responses.retrieve(created.id)
    assert retrieved.id == created.id and retrieved.output_text == created.output_text
    assert retrieved.status == created.status and retrieved.usage.output_tokens == created.usage.output_tokens
    newest_first = api.responses.input_items.list(created.id)
    assert [item.content[0].text for item in newest_first.data] == [ASK, "Hello."]
    first = api.responses.input_items.list(created.id, order="asc", limit=1)
    assert first.data[0].content[0].text == "Hello." and first.has_more
    rest = api.responses.input_items.list(created.id, order="asc", after=first.data[0].id)
    assert [item.id for item in rest.data] == [newest_first.data[0].id] and not rest.has_more
    with pytest.raises(openai.BadRequestError, match="limit"):
        api.responses.input_items.list(created.id, limit=101)
    api.responses.delete(created.id)
    for gone in (
        lambda: api.responses.retrieve(created.id),
        lambda: api.responses.delete(created.id),
        lambda: api.responses.create(model=model, input=ASK, previous_response_id=created.id),
    ):
        with pytest.raises(openai.NotFoundError, match="is not stored here"):
            gone()
    unkept = api.responses.create(model=model, input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="store false"):
        api.responses.input_items.list(unkept.id)


def test_responses_text_format_follows_the_schema(api, model):
    schema = {
        "type": "object",
        "properties": {"city": CITY},
        "required": ["city"],
        "additionalProperties": False,
    }
    done = api.responses.create(
        model=model,
        input=ASK,
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema}},
    )
    assert set(json.loads(done.output_text)) == {"city"}
    with api.responses.stream(
        model=model,
        input=ASK,
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema}},
    ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == done.output_text


def test_an_agent_runs_its_function_tool_to_completion(api, model):
    set_tracing_disabled(True)
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        asked.append(city)
        return "sunny, 21 degrees"

    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(
            model=model,
            openai_client=openai.AsyncOpenAI(
                base_url=str(api.base_url), api_key="unused", max_retries=0, timeout=300
            ),
        ),
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=40, temperature=0),
    )
    result = Runner.run_sync(agent, ASK, max_turns=4)
    assert len(asked) == 1, "the tool ran once (tool_choice resets to auto after the call)"
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


# the Messages API
def test_messages_create_and_stream_with_a_tool_round_trip(claude, model):
    tool = {
        "name": "get_weather",
        "description": "The current weather of a city",
        "input_schema": WEATHER["parameters"],
    }
    first = claude.messages.create(
        model=model,
        max_tokens=60,
        messages=[{"role": "user", "content": ASK}],
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )
    (use,) = first.content
    assert first.stop_reason == "tool_use" and use.type == "tool_use" and use.input["city"]
    turns = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    counted = claude.messages.count_tokens(model=model, messages=turns, tools=[tool])
    answer = claude.messages.create(
        model=model, max_tokens=20, messages=turns, tools=[tool], extra_body=GREEDY
    )
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted.input_tokens
    with claude.messages.stream(
        model=model, max_tokens=20, messages=turns, tools=[tool], extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert (
        streamed.content[0].text == answer.content[0].text
        and streamed.usage.output_tokens == answer.usage.output_tokens
    )


def test_messages_stop_sequences_and_max_tokens_map_to_stop_reason(claude, model):
    ask = [{"role": "user", "content": "Count from one to ten in words."}]
    long = claude.messages.create(model=model, max_tokens=30, messages=ask, extra_body=GREEDY)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 30
    word = long.content[0].text.split()[2].strip(",.")
    stopped = claude.messages.create(
        model=model, max_tokens=30, messages=ask, extra_body=GREEDY, stop_sequences=[word]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text and long.content[0].text.startswith(stopped.content[0].text)


# instructor and langchain
class Place(BaseModel):
    # NOTE: its schema then closes the object (additionalProperties false): SmolLM2 would add keys forever.
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_extracts_a_model(api, model, mode):
    client = instructor.from_openai(api, mode=mode)
    place = client.chat.completions.create(
        model=model,
        response_model=Place,
        max_retries=0,
        temperature=0,
        max_tokens=160,
        messages=[{"role": "user", "content": ASK}],
    )
    assert isinstance(place, Place) and place.city and place.country


def test_langchain_binds_a_tool_and_gets_the_call_back(stack_fp32, model):
    chat = ChatOpenAI(
        base_url=stack_fp32.http_url,
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=60,
        max_retries=0,
        timeout=300,
    )
    weather = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    bound = chat.bind_tools([weather], tool_choice="get_weather", parallel_tool_calls=False)
    ask = HumanMessage(ASK)
    called = bound.invoke([ask])
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"]
    answer = chat.bind_tools([weather]).invoke([ask, called, ToolMessage("sunny", tool_call_id=call["id"])])
    assert answer.content and not answer.tool_calls


# refusals
@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": ASK, "tools": [{"type": "web_search"}]}, "tools", "tools[0].type"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "input[0]"),
        ({"input": ASK, "truncation": "auto"}, "truncation", "truncation"),
        ({"input": ASK, "background": True}, "background", "unsupported parameter 'background'"),
        (
            {"input": ASK, "text": {"format": {"type": "json_schema", "name": "x"}}},
            "text",
            "needs its name and schema",
        ),
        ({"input": ASK, "previous_response_id": "resp_gone"}, "previous_response_id", "is not stored here"),
        ({"input": ASK, "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        (
            {"input": ASK, "chat_template_kwargs": {"tools": []}},
            "chat_template_kwargs",
            "chat_template_kwargs.tools",
        ),
    ],
)
def test_bad_responses_bodies_are_refused_naming_the_field(api, model, body, param, says):
    with pytest.raises(openai.APIStatusError) as caught:
        api.post("/responses", body={"model": model, **body}, cast_to=object)
    error = caught.value.body
    assert caught.value.status_code in (400, 404) and error["param"] == param and says in error["message"], (
        error
    )


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            {"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages[0].content",
        ),
        ({"max_tokens": 10, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {
                "max_tokens": 10,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "tool"},
            },
            "tool_choice of type tool needs",
        ),
        (
            {"max_tokens": 10, "messages": [{"role": "user", "content": "x"}], "mcp_servers": []},
            "mcp_servers",
        ),
    ],
)
def test_bad_messages_bodies_get_anthropics_400(claude, model, body, says):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.post("/v1/messages", body={"model": model, **body}, cast_to=object)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert says in error["error"]["message"], error
