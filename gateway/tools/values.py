"""Argument values written as text rather than JSON (Qwen3-Coder's XML calls, pythonic calls): read back by
the parameter's schema, and the Lark rule of a parameter's value for forced calls."""

import json


def from_text(text: str, schema: object) -> object:
    """A value written as plain text, read as the parameter's schema types it: a string stays text, numbers
    and booleans are parsed, anything else is read as JSON where it parses (else kept as text)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return text
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    try:
        return json.loads(text)
    except ValueError:
        return text


def string_rule(schema: object, quote: str) -> str | None:
    """The Lark expression of a string parameter's value (its enum's strings, or characters up to its
    maxLength, no newline, no `<`, no quote), between `quote`s; None for a parameter that is no string."""
    if not isinstance(schema, dict):
        return None
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return " | ".join(json.dumps(f"{quote}{v}{quote}", ensure_ascii=False) for v in schema["enum"])
    if schema.get("type") != "string":
        return None
    banned = "<\\n" + ("\\\\" + quote if quote else "")
    length = f"{{1,{schema['maxLength']}}}" if isinstance(schema.get("maxLength"), int) else "+"
    text = f"/[^{banned}]{length}/"
    return f"{json.dumps(quote)} {text} {json.dumps(quote)}" if quote else text
