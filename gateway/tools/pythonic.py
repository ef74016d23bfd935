"""Pythonic tool calls (vLLM's `pythonic`; Llama 3.2 and 4 templates that ask for them): the whole answer is a
Python list of calls, `[get_weather(city='Paris'), get_time()]`, with literal arguments, optionally between
`<|python_start|>` and `<|python_end|>`. An answer that starts with anything else is content."""

import ast
import json
from collections.abc import Mapping

from gateway.structured.lark import Tags
from gateway.tools import values
from gateway.tools.calls import Call, new_id

START, END = "<|python_start|>", "<|python_end|>"
MARKERS = (START, END)
BEFORE, CALLS, CONTENT = "before", "calls", "content"
# Names a model may write for JSON's literals.
NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def grammar(functions: list[tuple[str, dict]], many: bool, tags: Tags) -> str:
    rules, heads = [], []
    for f, (name, schema) in enumerate(functions):
        properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
        required = set(schema.get("required", ())) if isinstance(schema, dict) else set()
        items = []
        for p, (key, spec) in enumerate(properties.items()):
            rules.append(f"v{f}_{p}: {_value(spec)}")
            items.append((f'"{key}=" v{f}_{p}', key in required))
        rules.append(f'f{f}: "{name}(" {_arguments(items)} ")"')
        heads.append(f"f{f}")
    start = 'start: "[" call (", " call)* "]"' if many else 'start: "[" call "]"'
    return "\n".join([start, f"call: {' | '.join(heads)}", *rules]) + "\n"


def _value(schema: object) -> str:
    text = values.string_rule(schema, "'")
    if text is not None:
        return text
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "boolean":
        return '"True" | "False"'
    if kind == "integer":
        return "/-?[0-9]{1,18}/"
    if kind == "number":
        return r"/-?[0-9]{1,18}(\.[0-9]{1,18})?/"
    return f"%json {json.dumps(schema, ensure_ascii=False)}"


def _arguments(items: list[tuple[str, bool]]) -> str:
    """Keyword arguments in order, separated by `, `, the optional ones optional."""
    if not items:
        return '""'
    (first, required), rest = items[0], items[1:]
    tail = " ".join(f'", " {item}' if needed else f'(", " {item})?' for item, needed in rest)
    if required:
        return f"{first} {tail}".strip()
    return f"({first} {tail} | {_arguments(rest)})".replace("  ", " ")


class Parser:
    """Holds the answer while it may be a list of calls; each call is released once the list up to it parses
    (`[a(...), b(...)` closed with `]`); the rest is content once the answer is no such list."""

    def __init__(self, schemas: Mapping[str, dict] | None = None) -> None:
        self._state = BEFORE
        self._held = ""
        self._made = 0

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self._held += text
        if self._state == BEFORE:
            head = self._held.lstrip()
            if head.startswith(START):
                self._state, self._held = CALLS, head[len(START) :]
            elif head.startswith("["):
                self._state = CALLS
            elif not head or START.startswith(head):
                return "", []
            else:
                self._state = CONTENT
        if self._state == CONTENT:
            held, self._held = self._held, ""
            return held, []
        text = self._held.strip().removesuffix(END).rstrip()
        return "", self._new(_calls(text) or _calls(text + "]") or [])

    def finish(self) -> tuple[str, list[Call]]:
        held, self._held = self._held, ""
        if self._state != CALLS:
            return held, []
        text = held.strip().removesuffix(END).rstrip()
        calls = _calls(text)
        if calls is None:
            return ("" if self._made else held), []
        return "", self._new(calls)

    def _new(self, calls: list[Call]) -> list[Call]:
        new = calls[self._made :]
        self._made = max(self._made, len(calls))
        return new


def _calls(text: str) -> list[Call] | None:
    """The calls of a Python list of calls with literal keyword arguments; None for any other text."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not all(_is_call(node) for node in tree.elts):
        return None
    try:
        return [
            Call(new_id(), node.func.id, json.dumps({k.arg: _literal(k.value) for k in node.keywords}))
            for node in tree.elts
        ]
    except ValueError:
        return None


def _is_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args


def _literal(node: ast.AST) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in NAMES:
        return NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        return ast.literal_eval(node)
    raise ValueError("not a literal")
