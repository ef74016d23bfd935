"""Llama 3.1/3.2/3.3's JSON tool-call format (vLLM's `llama3_json`): the whole answer is the call, a JSON
object `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`; several calls are separated
by `; `. An answer that starts with anything else is content."""

from collections.abc import Mapping

from gateway.structured.lark import Tags
from gateway.tools.calls import Call, call_of, json_prefix, objects_schema

PYTHON_TAG = "<|python_tag|>"
MARKERS = (PYTHON_TAG,)
# Where the parser is: nothing decided yet, reading calls, all content.
BEFORE, CALLS, CONTENT = "before", "calls", "content"


def grammar(functions: list[tuple[str, dict]], many: bool, tags: Tags) -> str:
    start = 'start: call ("; " call)*' if many else "start: call"
    return f"{start}\ncall: %json {objects_schema(functions, 'parameters')}\n"


class Parser:
    """Holds the answer while it may be calls: released as content once it is not (it starts with no `{`,
    or an object in it is no call), as calls each time one is whole."""

    def __init__(self, schemas: Mapping[str, dict] | None = None) -> None:
        self._state = BEFORE
        self._held = ""

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self._held += text
        if self._state == BEFORE:
            head = self._held.lstrip()
            if head.startswith(PYTHON_TAG):
                self._state, self._held = CALLS, head[len(PYTHON_TAG) :]
            elif head.startswith("{"):
                self._state = CALLS
            elif not head or PYTHON_TAG.startswith(head):
                return "", []
            else:
                self._state = CONTENT
        if self._state == CONTENT:
            held, self._held = self._held, ""
            return held, []
        return self._calls(final=False)

    def finish(self) -> tuple[str, list[Call]]:
        if self._state == CALLS:
            return self._calls(final=True)
        held, self._held = self._held, ""
        return held, []

    def _calls(self, final: bool) -> tuple[str, list[Call]]:
        calls = []
        while True:
            rest = self._held.lstrip().removeprefix(";").lstrip()
            if not rest:
                return "", calls
            found = json_prefix(rest)
            call = call_of(found[0], "parameters") if found else None
            if call is None:
                if found is None and not final:
                    return "", calls
                # NOTE: not a call: the rest is content.
                self._state, held, self._held = CONTENT, self._held, ""
                return held, calls
            calls.append(call)
            self._held = rest[found[1] :]
