"""Random JSON schemas of the property-tested subset (docs/structured-outputs.md: strings with maxLength,
enum and const, bounded integers, booleans, null, objects with required and optional properties, bounded
arrays, anyOf, nested up to three levels), each with a valid instance drawn with it."""

import json
import string

from hypothesis import strategies as st

NAMES = st.text(string.ascii_lowercase + "_", min_size=1, max_size=8)
WORDS = st.text(string.ascii_letters + " ", min_size=1, max_size=6)


@st.composite
def _string(draw) -> tuple[dict, object]:
    kind = draw(st.sampled_from(["plain", "enum", "const"]))
    if kind == "enum":
        values = draw(st.lists(WORDS, min_size=1, max_size=4, unique=True))
        return {"type": "string", "enum": values}, draw(st.sampled_from(values))
    if kind == "const":
        value = draw(WORDS)
        return {"const": value}, value
    high = draw(st.integers(1, 12))
    low = draw(st.integers(0, high))
    value = draw(st.text(string.ascii_letters + string.digits + " ", min_size=low, max_size=high))
    return {"type": "string", "minLength": low, "maxLength": high}, value


@st.composite
def _integer(draw) -> tuple[dict, object]:
    low = draw(st.integers(-1000, 1000))
    high = draw(st.integers(low, low + 5000))
    return {"type": "integer", "minimum": low, "maximum": high}, draw(st.integers(low, high))


SCALARS = st.one_of(
    _string(),
    _integer(),
    st.just(({"type": "boolean"}, True)),
    st.just(({"type": "null"}, None)),
)


@st.composite
def _object(draw, children) -> tuple[dict, object]:
    names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    fields = {name: draw(children) for name in names}
    required = [name for name in names if draw(st.booleans())] or names[:1]
    schema = {
        "type": "object",
        "properties": {name: schema for name, (schema, _) in fields.items()},
        "required": required,
        "additionalProperties": False,
    }
    present = [name for name in names if name in required or draw(st.booleans())]
    return schema, {name: fields[name][1] for name in present}


@st.composite
def _array(draw, children) -> tuple[dict, object]:
    items, value = draw(children)
    high = draw(st.integers(1, 3))
    count = draw(st.integers(0, high))
    # NOTE: every item repeats the drawn instance: valid for the items schema, whatever it is.
    return {"type": "array", "items": items, "maxItems": high}, [value] * count


@st.composite
def _any_of(draw, children) -> tuple[dict, object]:
    first, second = draw(children), draw(children)
    return {"anyOf": [first[0], second[0]]}, draw(st.sampled_from([first[1], second[1]]))


def _nested(children):
    return st.one_of(_object(children), _array(children), _any_of(children))


# Schema and instance; the top level is an object, as response_format json_schema has it.
SCHEMAS = _object(st.recursive(SCALARS, _nested, max_leaves=6))


def text(instance: object) -> str:
    """The instance as the gateway's JSON options write it (compact, ", " and ": ")."""
    return json.dumps(instance, ensure_ascii=False)
