"""The constraints the structured-output measurements use (tools/grammar_engines.py and
tools/structured_overhead.py), each with a valid instance to walk: the shapes applications send, from a
one-word answer to a 40-field record."""

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    name: str
    kind: str  # json (a JSON schema, as text), regex, lark
    spec: str
    instance: str


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
    "required": ["name", "age", "email"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "gift": {"type": "boolean"},
    },
    "required": ["id", "status", "items", "address", "gift"],
    "additionalProperties": False,
}
WEATHER_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
_TYPES = ({"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"})
_VALUES = ('"text"', "7", "true", "1.5")
WIDE = {
    "type": "object",
    "properties": {f"field_{i}": _TYPES[i % 4] for i in range(40)},
    "required": [f"field_{i}" for i in range(40)],
    "additionalProperties": False,
}
ANY_JSON = {"type": "object"}

SAMPLES = (
    Sample(
        "person",
        "json",
        json.dumps(PERSON),
        '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}',
    ),
    Sample(
        "order",
        "json",
        json.dumps(ORDER),
        '{"id": 12, "status": "shipped", "items": [{"sku": "ABC-1234", "quantity": 2, "price": 9.5}, '
        '{"sku": "XYZ-0001", "quantity": 1, "price": 120}], "address": {"street": "1 Main St", '
        '"city": "Paris"}, "gift": false}',
    ),
    Sample(
        "tool_call",
        "json",
        json.dumps(WEATHER_CALL),
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    ),
    Sample(
        "wide_40",
        "json",
        json.dumps(WIDE),
        "{" + ", ".join(f'"field_{i}": {_VALUES[i % 4]}' for i in range(40)) + "}",
    ),
    Sample("json_object", "json", json.dumps(ANY_JSON), '{"answer": [1, 2, {"nested": "yes"}], "ok": null}'),
    Sample("date_regex", "regex", r"\d{4}-\d{2}-\d{2}", "2026-12-03"),
    Sample("choice", "regex", "(positive|negative|neutral)", "negative"),
)
