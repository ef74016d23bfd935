"""The calls in a request's streamed samples: each response's text split into content and completed calls
(GenerateResponse.tool_calls); a sample that called a tool and stopped finishes with TOOL_CALLS."""

from gateway.tools import hermes
from gateway.tools.request import ToolUse
from protos import generation_pb2

PARSERS = {"hermes": hermes.Parser}


class CallStreams:
    """One parser per sample of a request with tools (`parser`: a PARSERS name)."""

    def __init__(self, tools: ToolUse, parser: str) -> None:
        self._tools = tools
        self._make = PARSERS[parser]
        self._parsers: dict[int, hermes.Parser] = {}
        self._calls: dict[int, int] = {}

    def apply(self, reply: generation_pb2.GenerateResponse) -> None:
        """Moves the calls out of the reply's text into its tool_calls (in place)."""
        parser = self._parsers.setdefault(reply.index, self._make())
        content, calls = parser.feed(reply.text)
        if reply.finish_reason:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        made = self._calls.get(reply.index, 0)
        if not self._tools.parallel:
            calls = calls[: max(0, 1 - made)]
        self._calls[reply.index] = made + len(calls)
        reply.text = content
        for call in calls:
            reply.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
        if reply.finish_reason == generation_pb2.FINISH_REASON_STOP and self._calls[reply.index]:
            reply.finish_reason = generation_pb2.FINISH_REASON_TOOL_CALLS
