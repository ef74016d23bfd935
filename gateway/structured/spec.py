"""A request's constraint (GenerateRequest.constraint) checked against the limits and turned into the grammar
the engine compiles (llguidance's grammar text), keyed by its content."""

import hashlib
import json
from dataclasses import dataclass

import llguidance

from common.errors import InvalidArgument
from common.json_depth import json_depth
from protos import generation_pb2

# JSON is generated compactly, as json.dumps writes it: no free whitespace for a model to loop in. A schema's
# own "x-guidance" options take precedence.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Spec:
    """A constraint of one kind (json_schema, regex, choice, grammar; lark and top for the gateway's own) and
    its text: a schema as JSON, a regex, a grammar, the choices as a JSON list, or (top) llguidance's
    top-level grammar as JSON."""

    kind: str
    text: str

    @property
    def key(self) -> str:
        """Its identity for the cache of compiled grammars."""
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()

    def grammar(self) -> str:
        """llguidance's grammar of it; InvalidArgument if the text is not of its kind's form."""
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "grammar":
            try:
                return llguidance.grammar_from("grammar", self.text)
            except ValueError as err:
                raise InvalidArgument(f"constraint.grammar: {err}") from None
        if self.kind == "lark":  # the gateway's own (gateway.tools)
            return llguidance.LLMatcher.grammar_from_lark(self.text)
        if self.kind == "top":  # the gateway's own (gateway.reasoning)
            return self.text
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.text)
        return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)


def from_request(constraint: generation_pb2.Constraint, max_bytes: int, max_depth: int) -> Spec | None:
    """The request's constraint (None when unset); InvalidArgument naming the problem if it is empty, too
    large (UTF-8 bytes) or too deeply nested (a schema's objects and arrays), or not of its kind's form."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not constraint.json_object:
            raise InvalidArgument("constraint.json_object must be true when set")
        return Spec("json_schema", '{"type": "object"}')
    if kind == "choice":
        choices = list(constraint.choice.choices)
        if not choices or not all(choices):
            raise InvalidArgument("constraint.choice needs at least one choice, none of them empty")
        text = json.dumps(choices, ensure_ascii=False)
    else:
        text = getattr(constraint, kind)
    size = len(text.encode())
    if size > max_bytes:
        raise InvalidArgument(
            f"constraint.{kind} has {size} bytes; the limit is {max_bytes} (--max-constraint-bytes)"
        )
    if not text.strip():
        raise InvalidArgument(f"constraint.{kind} is empty")
    if kind == "json_schema":
        check_schema(text, max_depth, f"constraint.{kind}")
    return Spec(kind, text)


def check_schema(text: str, max_depth: int, where: str) -> object:
    """The schema parsed; InvalidArgument unless it is a JSON object (or boolean) nested at most max_depth
    deep."""
    # NOTE: measured on the text before json.loads, which recurses per level (RecursionError near 1000).
    depth = json_depth(text)
    if depth > max_depth:
        raise InvalidArgument(
            f"{where} is nested {depth} levels deep; the limit is {max_depth} (--max-constraint-depth)"
        )
    try:
        schema = json.loads(text)
    except ValueError as err:
        raise InvalidArgument(f"{where} is not valid JSON: {err}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidArgument(f"{where} must be a JSON object (a schema), got {type(schema).__name__}")
    return schema
