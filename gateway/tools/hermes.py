"""The Hermes/Qwen tool-call format: each call is a JSON object `{"name": ..., "arguments": {...}}` on its own
line between `<tool_call>` and `</tool_call>` in the assistant's text. Its grammar (for forced calls), its
parser, and how past calls and the tool list are written into a prompt whose chat template does not render
tools."""

import json
from collections.abc import Mapping

from gateway.structured.lark import Tags
from gateway.tools.calls import Call, call_of, objects_schema, partial

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MARKERS = (OPEN, CLOSE)


def call_text(name: str, arguments: object) -> str:
    """One call as the model writes it."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def grammar(functions: list[tuple[str, dict]], many: bool, tags: Tags) -> str:
    """A Lark grammar (llguidance's, with %json) of one call, or of one or more (`many`), of these functions
    (name, parameters schema), with arguments that follow the function's schema."""
    start = f"start: call ({tags.literal(chr(10))} call)*" if many else "start: call"
    return (
        f"{start}\ncall: {tags.literal(OPEN + chr(10))} body {tags.literal(chr(10) + CLOSE)}\n"
        f"body: %json {objects_schema(functions)}\n"
    )


def tools_prompt(tools: list[dict]) -> str:
    """The system prompt's part that lists the tools, for a chat template that does not render them."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call functions to answer. The functions, as JSON signatures, are listed between "
        f"<tools> and </tools>:\n<tools>\n{listed}\n</tools>\nTo call one, answer with a JSON object holding "
        f"its name and its arguments between {OPEN} and {CLOSE}, one per call:\n"
        f'{OPEN}\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n{CLOSE}'
    )


def response_text(content: str) -> str:
    """A tool's result as written into a prompt whose template does not render tools."""
    return f"<tool_response>\n{content}\n</tool_response>"


class Parser:
    """One sample's text split into content and calls as it streams: text that may be the start of a call is
    held back until it is decided. A call whose JSON does not parse (or names no function) stays content."""

    def __init__(self, schemas: Mapping[str, dict] | None = None) -> None:
        self._held = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content released by `text`, and the calls it completed."""
        self._held += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    return content, calls
                body, self._held, self._in_call = self._held[:end], self._held[end + len(CLOSE) :], False
                call = _parse(body)
                if call is None:
                    content += OPEN + body + CLOSE
                else:
                    calls.append(call)
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                content += self._held[:start]
                self._held, self._in_call = self._held[start + len(OPEN) :], True
                continue
            keep = partial(self._held, OPEN)
            content += self._held[: len(self._held) - keep]
            self._held = self._held[len(self._held) - keep :]
            return content, calls

    def finish(self) -> tuple[str, list[Call]]:
        """What is still held at the end: an unclosed call counts if its JSON is whole."""
        held, in_call = self._held, self._in_call
        self._held, self._in_call = "", False
        if not in_call:
            return held, []
        call = _parse(held)
        return ("", [call]) if call is not None else (OPEN + held, [])


def _parse(body: str) -> Call | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return call_of(value)
