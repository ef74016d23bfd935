"""A request's tools, checked: names, parameter schemas, tool_choice and parallel_tool_calls; and the
constraint a forcing choice (`required`, a named function) sets."""

import json
import re
from dataclasses import dataclass

from common.errors import InvalidArgument
from gateway.structured.lark import Tags
from gateway.structured.spec import Spec, check_schema
from gateway.tools.formats import ToolFormat
from protos import generation_pb2

# OpenAI's rule for function names.
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MODES = ("auto", "none", "required")


@dataclass(frozen=True, slots=True)
class ToolUse:
    """The request's tools (OpenAI's `tools` entries, for the chat template), what tool_choice asks, and
    whether one answer may hold several calls."""

    tools: tuple[dict, ...]
    # "auto", "required", or the name of the function that must be called ("none" is no ToolUse)
    choice: str
    parallel: bool

    @property
    def schemas(self) -> list[tuple[str, dict]]:
        return [(tool["function"]["name"], tool["function"]["parameters"]) for tool in self.tools]

    def constraint(self, fmt: ToolFormat, tags: Tags) -> Spec | None:
        """The grammar of the calls a forcing choice requires, in the model's format; None for `auto`."""
        if self.choice == "auto":
            return None
        if self.choice == "required":
            return Spec("lark", fmt.grammar(self.schemas, self.parallel, tags))
        named = [(name, schema) for name, schema in self.schemas if name == self.choice]
        return Spec("lark", fmt.grammar(named, False, tags))


def from_request(
    request: generation_pb2.GenerateRequest, max_tools: int, max_bytes: int, max_depth: int
) -> ToolUse | None:
    """The request's ToolUse (None without tools, or with tool_choice "none"); InvalidArgument naming the
    problem: tools without chat messages or beside a constraint, more than max_tools, a tool without a
    (valid, unique) name, parameters that are no JSON schema object or exceed the constraint limits, a
    tool_choice naming no tool."""
    choice = _choice(request)
    if not request.tools:
        if choice not in ("auto", "none"):
            raise InvalidArgument(f"tool_choice {choice!r} needs tools: add the function to `tools`")
        return None
    if not request.messages:
        raise InvalidArgument("tools need chat messages: send messages, not prompt or token_ids")
    if len(request.tools) > max_tools:
        raise InvalidArgument(
            f"tools has {len(request.tools)} entries; the limit is {max_tools} (--max-tools)"
        )
    if choice == "none":
        return None
    if request.HasField("constraint"):
        raise InvalidArgument("tools and a constraint (response_format) cannot be combined: give one of them")
    tools, seen, size = [], set(), 0
    for i, tool in enumerate(request.tools):
        if not tool.name:
            raise InvalidArgument(f"tools[{i}] has no name: every function needs one")
        if not NAME.match(tool.name):
            raise InvalidArgument(
                f"tools[{i}].name {tool.name[:80]!r} is invalid: use 1 to 64 letters, digits, _ or -"
            )
        if tool.name in seen:
            raise InvalidArgument(f"tools[{i}].name {tool.name!r} is given twice: function names are unique")
        seen.add(tool.name)
        size += len(tool.parameters.encode())
        if size > max_bytes:
            raise InvalidArgument(
                f"the tools' parameter schemas have at least {size} bytes; the limit is {max_bytes} "
                "(--max-constraint-bytes)"
            )
        parameters = (
            check_schema(tool.parameters, max_depth, f"tools[{i}].parameters")
            if tool.parameters
            else {"type": "object", "properties": {}}
        )
        function = {"name": tool.name, "description": tool.description, "parameters": parameters}
        tools.append({"type": "function", "function": function})
    if choice not in (*MODES, *seen):
        raise InvalidArgument(f"tool_choice names the function {choice!r}, which is not in tools")
    parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    return ToolUse(tuple(tools), choice, parallel)


def _choice(request: generation_pb2.GenerateRequest) -> str:
    which = request.tool_choice.WhichOneof("choice")
    if which is None:
        return "auto"
    if which == "function":
        if not request.tool_choice.function:
            raise InvalidArgument("tool_choice.function is empty: name the function to call")
        return request.tool_choice.function
    if request.tool_choice.mode not in MODES:
        raise InvalidArgument(
            f"tool_choice {request.tool_choice.mode[:40]!r} is unknown: use auto, none, required or a "
            "function"
        )
    return request.tool_choice.mode


def arguments(text: str) -> object:
    """A past call's arguments for a chat template: the parsed JSON where it parses, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text
