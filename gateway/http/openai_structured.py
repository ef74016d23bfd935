"""The structured-output and tool fields of OpenAI request bodies: `response_format` (json_object,
json_schema), vLLM's `structured_outputs` and its older `guided_*` fields, `tools`, `tool_choice` and
`parallel_tool_calls`, checked and set on the GenerateRequest (the gateway then checks them as any gRPC
request's: gateway.structured, gateway.tools)."""

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.http.errors import invalid
from protos import generation_pb2


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: one of these."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class Function(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: Function


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class CallFunction(_Body):
    name: str
    arguments: str


class MessageToolCall(_Body):
    id: str
    type: Literal["function"]
    function: CallFunction


class Constrained(_Body):
    """The constraint fields both bodies take."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def set_constraint(body: Constrained, request: generation_pb2.GenerateRequest) -> None:
    """The body's one constraint on the request; 400 if it gives several or an empty one."""
    given = _given(body)
    if len(given) > 1:
        raise invalid(f"give one constraint, got {' and '.join(name for name, _ in given)}", given[1][0])
    if not given:
        return
    name, (kind, value) = given[0]
    constraint = request.constraint
    if kind == "json_object":
        constraint.json_object = True
    elif kind == "json_schema":
        constraint.json_schema = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    elif kind == "choice":
        constraint.choice.choices.extend(value)
    else:
        setattr(constraint, kind, value)


def _given(body: Constrained) -> list[tuple[str, tuple[str, object]]]:
    """(parameter, (Constraint field, value)) of each constraint the body sets."""
    given = []
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            given.append(("response_format", ("json_object", True)))
        elif response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise invalid("response_format json_schema needs json_schema.schema", "response_format")
        else:
            given.append(("response_format", ("json_schema", response_format.json_schema.schema_)))
    outputs = body.structured_outputs
    if outputs is not None:
        fields = [
            (kind, value)
            for kind, value in (
                ("json_schema", outputs.json_),
                ("regex", outputs.regex),
                ("choice", outputs.choice),
                ("grammar", outputs.grammar),
                ("json_object", outputs.json_object or None),
            )
            if value is not None
        ]
        if len(fields) != 1:
            raise invalid("structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                          "structured_outputs")  # fmt: skip
        given.append(("structured_outputs", fields[0]))
    for name, kind in (
        ("guided_json", "json_schema"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if getattr(body, name) is not None:
            given.append((name, (kind, getattr(body, name))))
    return given


def set_tools(
    tools: list[ToolDef] | None,
    choice: str | NamedToolChoice | None,
    parallel: bool | None,
    request: generation_pb2.GenerateRequest,
) -> None:
    request.tools.extend(function_tools(tools))
    if isinstance(choice, str):
        request.tool_choice.mode = choice
    elif choice is not None:
        request.tool_choice.function = choice.function.name
    if parallel is not None:
        request.parallel_tool_calls = parallel


def function_tools(tools: list[ToolDef] | None) -> list[generation_pb2.Tool]:
    """The request's tools as the gateway takes them (parameters as JSON text)."""
    return [
        generation_pb2.Tool(
            name=tool.function.name,
            description=tool.function.description or "",
            parameters=""
            if tool.function.parameters is None
            else json.dumps(tool.function.parameters, ensure_ascii=False),
        )
        for tool in tools or ()
    ]
