"""Qwen3-Coder's XML tool-call format (vLLM's `qwen3_coder`): each call is a `<tool_call>` block holding
`<function=NAME>` and, per argument, `<parameter=KEY>`, the value on its own lines, `</parameter>`, then
`</function>`, each tag on a line of its own; values are written as text and read back by the function's
parameter schema."""

import json
import re
from collections.abc import Mapping

from gateway.structured.lark import Tags
from gateway.tools import values
from gateway.tools.calls import Call, new_id, partial

OPEN, CLOSE, NL = "<tool_call>", "</tool_call>", "\n"
MARKERS = (OPEN, CLOSE)
FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def grammar(functions: list[tuple[str, dict]], many: bool, tags: Tags) -> str:
    rules = [f"start: call ({tags.literal(NL)} call)*" if many else "start: call"]
    heads = []
    for f, (name, schema) in enumerate(functions):
        properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
        required = set(schema.get("required", ())) if isinstance(schema, dict) else set()
        items = []
        for p, (key, spec) in enumerate(properties.items()):
            value = values.string_rule(spec, "") or f"%json {json.dumps(spec, ensure_ascii=False)}"
            rules.append(f"v{f}_{p}: {value}")
            item = f"{json.dumps(f'<parameter={key}>{NL}')} v{f}_{p} {json.dumps(NL + '</parameter>' + NL)}"
            items.append(item if key in required else f"({item})?")
        rules.append(f'f{f}: {json.dumps(f"<function={name}>{NL}")} {" ".join(items)} "</function>"')
        heads.append(f"f{f}")
    rules.insert(1, f"call: {tags.literal(OPEN + NL)} ({' | '.join(heads)}) {tags.literal(NL + CLOSE)}")
    return "\n".join(rules) + "\n"


class Parser:
    """Content outside `<tool_call>` blocks; each block, once closed, read as a call of a function named by
    `<function=...>` (else it stays content); arguments typed by `schemas` (function name -> parameters)."""

    def __init__(self, schemas: Mapping[str, dict] | None = None) -> None:
        self._schemas = schemas or {}
        self._held = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self._held += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    return content, calls
                body, self._held, self._in_call = self._held[:end], self._held[end + len(CLOSE) :], False
                call = self._parse(body)
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
        """What is held at the end: an unclosed block counts if its function block is closed."""
        held, in_call = self._held, self._in_call
        self._held, self._in_call = "", False
        if not in_call:
            return held, []
        call = self._parse(held) if "</function>" in held else None
        return ("", [call]) if call is not None else (OPEN + held, [])

    def _parse(self, body: str) -> Call | None:
        found = FUNCTION.search(body)
        if found is None:
            return None
        name = found[1].strip()
        properties = self._schemas.get(name, {}).get("properties", {})
        arguments = {
            key.strip(): values.from_text(value, properties.get(key.strip()))
            for key, value in PARAMETER.findall(found[2])
        }
        return Call(new_id(), name, json.dumps(arguments, ensure_ascii=False))
