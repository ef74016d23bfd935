"""Mistral's tool-call format (vLLM's `mistral`): calls follow the `[TOOL_CALLS]` token, as a JSON list of
`{"name": ..., "arguments": {...}}` objects (tokenizers before v11) or as `name[ARGS]{...}` per call (v11 and
later, whose vocabulary has `[ARGS]`). Text before it is content. Call ids are 9 letters and digits, the only
ids Mistral's templates take back."""

import json
import random
import string
from collections.abc import Mapping

from gateway.structured.lark import Tags
from gateway.tools.calls import Call, call_of, json_prefix, objects_schema, partial

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
MARKERS = (TOOL_CALLS, ARGS)
_ID_CHARS = string.ascii_letters + string.digits


def new_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


def grammar(functions: list[tuple[str, dict]], many: bool, tags: Tags) -> str:
    marker = tags.literal(TOOL_CALLS)
    if tags.token(ARGS) is not None:
        named = " | ".join(
            f"{tags.literal(name)} {tags.literal(ARGS)} %json {json.dumps(parameters, ensure_ascii=False)}"
            for name, parameters in functions
        )
        return f"start: call{'+' if many else ''}\ncall: {marker} ({named})\n"
    items = 'call (", " call)*' if many else "call"
    return f'start: {marker} "[" {items} "]"\ncall: %json {objects_schema(functions)}\n'


class Parser:
    """Content up to `[TOOL_CALLS]`, then calls, each released once whole (a list's items one by one);
    what does not parse as calls is content, the marker with it."""

    def __init__(self, schemas: Mapping[str, dict] | None = None) -> None:
        self._held = ""
        self._in_calls = False
        # Items of the current list already released as calls.
        self._listed = 0

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self._held += text
        content, calls = "", []
        while True:
            if not self._in_calls:
                start = self._held.find(TOOL_CALLS)
                if start < 0:
                    keep = partial(self._held, TOOL_CALLS)
                    content += self._held[: len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep :]
                    return content, calls
                content += self._held[:start]
                self._held, self._in_calls, self._listed = self._held[start + len(TOOL_CALLS) :], True, 0
            found, done = self._read()
            calls += found
            if not done:
                return content, calls

    def finish(self) -> tuple[str, list[Call]]:
        """What is held at the end: calls left unfinished are content (the marker with them), but for the
        items of a list already released."""
        held, self._held = self._held, ""
        if not self._in_calls:
            return held, []
        self._in_calls = False
        return ("" if self._listed else TOOL_CALLS + held), []

    def _read(self) -> tuple[list[Call], bool]:
        """The calls now whole after the marker, and whether they ended (the rest is content again)."""
        head = self._held.lstrip()
        if head.startswith("["):
            return self._list(head)
        cut = head.find(ARGS)
        found = json_prefix(head[cut + len(ARGS) :].lstrip()) if cut >= 0 else None
        if found is None or not isinstance(found[0], dict) or not head[:cut].strip():
            return [], False
        rest = head[cut + len(ARGS) :].lstrip()[found[1] :]
        self._held, self._in_calls = rest, False
        return [Call(new_id(), head[:cut].strip(), json.dumps(found[0], ensure_ascii=False))], True

    def _list(self, head: str) -> tuple[list[Call], bool]:
        whole = json_prefix(head)
        items, at = [], 1
        while (found := json_prefix(head[at:].lstrip(" \n,"))) is not None:
            items.append(found[0])
            at = len(head) - len(head[at:].lstrip(" \n,")) + found[1]
        calls = [call_of(item) for item in items]
        if any(call is None for call in calls):
            return [], False
        new = [Call(new_id(), c.name, c.arguments) for c in calls[self._listed :]]
        self._listed = len(calls)
        if whole is not None:
            self._held, self._in_calls = head[whole[1] :], False
            return new, True
        return new, False
