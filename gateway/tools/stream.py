"""The calls in a request's streamed samples: each response's text split into content and completed calls
(GenerateResponse.tool_calls); a sample that called a tool and stopped finishes with TOOL_CALLS."""

from collections.abc import Mapping

from gateway.tools.calls import Call
from gateway.tools.formats import CallParser, ToolFormat
from gateway.tools.request import ToolUse
from protos import generation_pb2


class CallStreams:
    """One parser (of the model's format) per sample of a request with tools. A resumed request's samples go
    on from the text their client received (`received`, by sample): the calls in it were sent."""

    def __init__(self, tools: ToolUse, fmt: ToolFormat, received: Mapping[int, str] | None = None) -> None:
        self._tools = tools
        self._fmt = fmt
        self._schemas = dict(tools.schemas)
        self._parsers: dict[int, CallParser] = {}
        self._calls: dict[int, int] = {}
        for index, text in (received or {}).items():
            self._allowed(index, self._parser(index).feed(text)[1])

    def apply(self, reply: generation_pb2.GenerateResponse) -> None:
        """Moves the calls out of the reply's text into its tool_calls (in place)."""
        parser = self._parser(reply.index)
        content, calls = parser.feed(reply.text)
        if reply.finish_reason:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        calls = self._allowed(reply.index, calls)
        reply.text = content
        for call in calls:
            reply.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
        if reply.finish_reason == generation_pb2.FINISH_REASON_STOP and self._calls[reply.index]:
            reply.finish_reason = generation_pb2.FINISH_REASON_TOOL_CALLS

    def _parser(self, index: int) -> CallParser:
        if index not in self._parsers:
            self._parsers[index] = self._fmt.parser(self._schemas)
        return self._parsers[index]

    def _allowed(self, index: int, calls: list[Call]) -> list[Call]:
        """The calls sample `index` may make of these (one in all unless parallel), counted."""
        made = self._calls.get(index, 0)
        if not self._tools.parallel:
            calls = calls[: max(0, 1 - made)]
        self._calls[index] = made + len(calls)
        return calls
