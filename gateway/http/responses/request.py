"""Responses API bodies, checked and turned into a chat GenerateRequest: `instructions` as the system
message, `input` (a string, or message, function_call and function_call_output items) after the stored
conversation of `previous_response_id`, `text.format` as the constraint, function tools."""

import json
import uuid
from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag

from gateway.http.errors import HttpError, invalid
from gateway.http.openai_request import Int32, _Body
from protos import generation_pb2


class InputText(_Body):
    type: Literal["input_text", "output_text"]
    text: str
    # an output_text part fed back carries these
    annotations: list | None = None
    logprobs: list | None = None


class Message(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCall(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class Reasoning(_Body):
    """An earlier reasoning item fed back: accepted, not rendered (chat templates drop past reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list = []
    content: list | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _kind(item: object) -> str:
    """An input item's type: a message may leave it out (EasyInputMessage)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if isinstance(kind, str) else ""


Item = Annotated[
    Annotated[Message, Tag("message")]
    | Annotated[FunctionCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")]
    | Annotated[Reasoning, Tag("reasoning")],
    Discriminator(_kind),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class Text(_Body):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ReasoningOptions(_Body):
    """Accepted and ignored: a model reasons as its chat template has it (chat_template_kwargs)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    reasoning: ReasoningOptions | None = None
    truncation: Literal["disabled"] | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    # accepted and ignored (they label the caller, or choose among OpenAI's own services)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    # pagedserve's and vLLM's: variables for the chat template
    chat_template_kwargs: dict | None = None


def generate_request(
    body: ResponsesRequest,
    request_id: str,
    max_model_len: int,
    history: tuple[generation_pb2.ChatMessage, ...],
) -> generation_pb2.GenerateRequest:
    """The GenerateRequest of a Responses body after the conversation `history` (previous_response_id's)."""
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise invalid("max_output_tokens must be at least 1", "max_output_tokens")
    sampling = generation_pb2.SamplingParams(max_tokens=body.max_output_tokens or max_model_len)
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            setattr(sampling, name, getattr(body, name))
    request = generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if body.instructions:
        request.messages.add(role="system", content=body.instructions)
    request.messages.extend(history)
    request.messages.extend(input_messages(body))
    if body.text is not None and body.text.format is not None:
        _set_format(body.text.format, request)
    for tool in body.tools or ():
        parameters = "" if tool.parameters is None else json.dumps(tool.parameters, ensure_ascii=False)
        request.tools.add(name=tool.name, description=tool.description or "", parameters=parameters)
    if isinstance(body.tool_choice, str):
        request.tool_choice.mode = body.tool_choice
    elif body.tool_choice is not None:
        request.tool_choice.function = body.tool_choice.name
    if body.parallel_tool_calls is not None:
        request.parallel_tool_calls = body.parallel_tool_calls
    if body.chat_template_kwargs is not None:
        request.chat_template_kwargs = json.dumps(body.chat_template_kwargs, ensure_ascii=False)
    return request


def input_messages(body: ResponsesRequest) -> list[generation_pb2.ChatMessage]:
    """The chat messages of `input`: a function_call joins the assistant message before it (or starts one),
    a function_call_output is a tool message."""
    if isinstance(body.input, str):
        return [generation_pb2.ChatMessage(role="user", content=body.input)]
    messages: list[generation_pb2.ChatMessage] = []
    for i, item in enumerate(body.input):
        if isinstance(item, Message):
            messages.append(generation_pb2.ChatMessage(role=item.role, content=_text(item.content)))
        elif isinstance(item, FunctionCall):
            if not messages or messages[-1].role != "assistant":
                messages.append(generation_pb2.ChatMessage(role="assistant"))
            messages[-1].tool_calls.add(id=item.call_id, name=item.name, arguments=item.arguments)
        elif isinstance(item, FunctionCallOutput):
            if not item.call_id:
                raise invalid(f"input[{i}].call_id is empty: give the call_id of the function_call", "input")
            messages.append(
                generation_pb2.ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id)
            )
    if not messages:
        raise invalid("input holds no message: give a string or at least one message item", "input")
    return messages


# The id prefix of each input item type, for the items a request sends without one.
ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponsesRequest) -> list[dict]:
    """`input` as the API's input items (GET /v1/responses/{id}/input_items): a string is one user message,
    a message's string content one input_text part, each item given an id if it came without one."""
    if isinstance(body.input, str):
        items: list[dict] = [{"type": "message", "role": "user", "content": body.input}]
    else:
        items = [item.model_dump(exclude_none=True) for item in body.input]
    for item in items:
        item.setdefault("type", "message")
        item.setdefault("id", new_id(ITEM_PREFIXES[item["type"]]))
        if item["type"] == "message":
            item.setdefault("status", "completed")
            if isinstance(item["content"], str):
                item["content"] = [{"type": "input_text", "text": item["content"]}]
    return items


def not_stored(response_id: str) -> HttpError:
    return HttpError(
        404,
        f"response {response_id[:80]!r} is not stored here: it was made with store false, by another API "
        "key or gateway, deleted, or dropped as the oldest (docs/api.md, Responses)",
        "invalid_request_error",
        None,
        "response_not_found",
    )


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _set_format(fmt: TextFormat, request: generation_pb2.GenerateRequest) -> None:
    """`text.format` as the constraint (the gateway checks it as any constraint)."""
    if fmt.type == "json_object":
        request.constraint.json_object = True
    elif fmt.type == "json_schema":
        if fmt.name is None or fmt.schema_ is None:
            raise invalid("text.format json_schema needs its name and schema", "text")
        request.constraint.json_schema = json.dumps(fmt.schema_, ensure_ascii=False)


def not_found(response_id: str) -> HttpError:
    return HttpError(
        404,
        f"previous_response_id {response_id[:80]!r} is not stored here: it was made with store false, by "
        "another API key or gateway, or dropped as the oldest (docs/api.md, Responses)",
        "invalid_request_error",
        "previous_response_id",
        "previous_response_not_found",
    )
