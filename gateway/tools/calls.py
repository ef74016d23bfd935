"""What every tool-call format shares: a parsed call, call ids, and the JSON schema of a call object."""

import json
import uuid
from dataclasses import dataclass

from gateway.structured.spec import JSON_OPTIONS


@dataclass(frozen=True, slots=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text


def new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call_of(value: object, key: str = "arguments") -> Call | None:
    """The call a parsed JSON object holds (`{"name": ..., key: {...}}`, `arguments` or `parameters` either
    way); None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(key, value.get("parameters" if key == "arguments" else "arguments", {}))
    return Call(new_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def objects_schema(functions: list[tuple[str, dict]], key: str = "arguments") -> str:
    """The JSON schema (as JSON text, for Lark's %json) of one call object of any of these functions (name,
    parameters schema): `{"name": <const>, key: <its parameters>}`."""
    one_of = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, key: parameters},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for name, parameters in functions
    ]
    return json.dumps({"oneOf": one_of, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


def json_prefix(text: str) -> tuple[object, int] | None:
    """The JSON value at the head of `text` and where it ends, or None while it is not whole (or not JSON)."""
    try:
        return json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
