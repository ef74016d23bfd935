"""Constrained decoding in the gateway (gateway.structured) with the real grammar engine and SmolLM2's
tokenizer: constraints checked against their limits, compiled (and cached), matchers whose masks allow a
valid output token by token, and the packed masks compute unpacks."""

import json
import time

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from transformers import AutoTokenizer

from common.errors import FailedPrecondition, InvalidArgument
from common.model_files import local_copy
from compute_service import constraints
from gateway.structured import matcher as matchers
from gateway.structured import spec
from gateway.structured.grammars import Grammars
from gateway.structured.limits import ConstraintLimits
from protos import generation_pb2
from tests.structured_schemas import SCHEMAS, text

LIMITS = ConstraintLimits()
DEEP: object = 1
for _ in range(34):
    DEEP = [DEEP]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(local_copy("smollm2").path)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    grammars = Grammars(tokenizer, LIMITS)
    grammars.prepare(len(tokenizer), [tokenizer.eos_token_id])
    return grammars


def matcher(grammars, tokenizer, kind: str, value) -> matchers.Matcher:
    constraint = generation_pb2.Constraint(**{kind: value})
    found = spec.from_request(constraint, LIMITS.max_constraint_bytes, LIMITS.max_constraint_depth)
    return grammars.matcher(found, len(tokenizer), [tokenizer.eos_token_id])


def allowed(m: matchers.Matcher) -> np.ndarray:
    return np.unpackbits(m.mask().view(np.uint8), bitorder="little").astype(bool)


def walk(m: matchers.Matcher, tokenizer, output: str) -> None:
    """Feeds the output's tokens, each of which its mask must allow."""
    for token in tokenizer.encode(output, add_special_tokens=False):
        assert allowed(m)[token], f"{tokenizer.decode([token])!r} refused in {output!r}"
        m.accept(token)


# checks and limits
@pytest.mark.parametrize(
    ("kind", "value", "says"),
    [
        ("json_schema", "{not json", "constraint.json_schema is not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("json_schema", json.dumps({"a": DEEP}), "nested 35 levels deep; the limit is 32"),
        (
            "json_schema",
            json.dumps({"type": "string", "description": "x" * 70_000}),
            "--max-constraint-bytes",
        ),
        ("regex", " ", "constraint.regex is empty"),
        ("json_object", False, "must be true"),
    ],
)
def test_constraints_are_refused_before_compiling_naming_the_problem(kind, value, says):
    constraint = generation_pb2.Constraint(**{kind: value})
    with pytest.raises(InvalidArgument, match=says):
        spec.from_request(constraint, LIMITS.max_constraint_bytes, LIMITS.max_constraint_depth)


def test_empty_choices_are_refused():
    for choices in ([], ["yes", ""]):
        constraint = generation_pb2.Constraint(choice=generation_pb2.Choices(choices=choices))
        with pytest.raises(InvalidArgument, match="at least one choice, none of them empty"):
            spec.from_request(constraint, 100, 4)


@pytest.mark.parametrize(
    ("kind", "value", "says"),
    [
        (
            "json_schema",
            json.dumps({"type": "object", "if": {"type": "object"}}),
            r'Unimplemented keys: \["if"\]',
        ),
        ("json_schema", json.dumps({"type": "objekt"}), "Invalid type: objekt"),
        ("json_schema", json.dumps({"$ref": "http://example.org/s.json"}), "not present in a registry"),
        ("regex", "(abc", "unclosed group"),
        ("grammar", "start: missing_rule", 'unknown name: "missing_rule"'),
    ],
)
def test_what_the_engine_cannot_compile_is_refused_with_its_reason(grammars, tokenizer, kind, value, says):
    with pytest.raises(InvalidArgument, match=f"constraint.{kind} is not supported: .*{says}"):
        matcher(grammars, tokenizer, kind, value)


def test_a_compile_past_its_time_limit_is_refused_within_it_and_others_still_compile(tokenizer):
    slow = Grammars(tokenizer, ConstraintLimits(max_constraint_compile_ms=20))
    slow.prepare(len(tokenizer), [tokenizer.eos_token_id])
    words = "|".join(f"w{i:05d}xyz" for i in range(20_000))
    start = time.monotonic()
    with pytest.raises(InvalidArgument, match="did not compile within 20 ms"):
        slow.matcher(spec.Spec("regex", f"({words})"), len(tokenizer), [tokenizer.eos_token_id])
    assert time.monotonic() - start < 0.5
    quick = slow.matcher(spec.Spec("regex", "(yes|no)"), len(tokenizer), [tokenizer.eos_token_id])
    walk(quick, tokenizer, "yes")
    assert quick.stopped


def test_a_model_whose_vocabulary_the_tokenizer_overflows_refuses_constraints_with_the_reason(tokenizer):
    """A vocabulary smaller than the tokenizer's (a test model's) cannot take the engine's tokenizer: start-up
    logs it and goes on; a constrained request is refused with the reason, not an internal error."""
    small = Grammars(tokenizer, LIMITS)
    small.prepare_at_start(256, [0])
    with pytest.raises(FailedPrecondition, match="constraints are unavailable with this model and tokenizer"):
        small.matcher(spec.Spec("regex", "(yes|no)"), 256, [0])
    quick = small.matcher(spec.Spec("regex", "(yes|no)"), len(tokenizer), [tokenizer.eos_token_id])
    walk(quick, tokenizer, "no")
    assert quick.stopped


def test_compiled_constraints_are_cached_by_content(grammars, tokenizer):
    schema = json.dumps(
        {"type": "object", "properties": {"cached": {"type": "integer"}}, "required": ["cached"]}
    )
    start = time.perf_counter()
    first = matcher(grammars, tokenizer, "json_schema", schema)
    compile_s = time.perf_counter() - start
    second = matcher(grammars, tokenizer, "json_schema", schema)
    assert first is not second and grammars._cache[spec.Spec("json_schema", schema).key] is not None
    walk(first, tokenizer, '{"cached": 1}')
    assert first.stopped and not second.stopped, "a cached grammar gives each sample its own matcher"
    assert compile_s > 0


# matchers
def test_a_json_schema_allows_its_instance_and_nothing_else_at_each_step(grammars, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    m = matcher(grammars, tokenizer, "json_schema", json.dumps(schema))
    assert allowed(m).sum() < len(tokenizer) // 100, "only the tokens that open the object"
    assert not allowed(m)[tokenizer.encode("hello", add_special_tokens=False)[0]]
    walk(m, tokenizer, '{"n": 42}')
    assert m.stopped, "after the closing brace nothing may follow"


def test_regex_choice_and_lark_grammars_match(grammars, tokenizer):
    date = matcher(grammars, tokenizer, "regex", r"\d{4}-\d{2}-\d{2}")
    walk(date, tokenizer, "2026-12-03")
    assert date.stopped
    choice = matcher(grammars, tokenizer, "choice", generation_pb2.Choices(choices=["red", "green"]))
    assert not allowed(choice)[tokenizer.encode("blue", add_special_tokens=False)[0]]
    walk(choice, tokenizer, "green")
    lark = matcher(grammars, tokenizer, "grammar", 'start: "a" b+\nb: "b"')
    walk(lark, tokenizer, "abbb")
    assert not lark.stopped and allowed(lark)[tokenizer.eos_token_id], "b+ may go on or end"


def test_gbnf_grammars_are_accepted_too(grammars, tokenizer):
    gbnf = matcher(grammars, tokenizer, "grammar", 'root ::= "x" [0-9]')
    walk(gbnf, tokenizer, "x7")
    assert gbnf.stopped


def test_a_fresh_matcher_starts_over_and_prefetched_masks_equal_computed_ones(grammars, tokenizer):
    m = matcher(grammars, tokenizer, "regex", "(abc|abd)e")
    walk(m, tokenizer, "ab")
    other = m.fresh()
    matchers.prefetch([m, other])
    prefetched = (allowed(m).copy(), allowed(other).copy())
    m._mask = other._mask = None
    assert (allowed(m) == prefetched[0]).all() and (allowed(other) == prefetched[1]).all()
    assert not (prefetched[0] == prefetched[1]).all(), "the fresh one is at the start"


def test_packed_masks_unpack_in_compute_to_the_same_tokens(grammars, tokenizer):
    rows = [
        matcher(grammars, tokenizer, "regex", r"[0-9]+"),
        matcher(grammars, tokenizer, "choice", generation_pb2.Choices(choices=["no"])),
    ]
    got_rows, blocked = constraints.unpack([0, 2], matchers.packed(rows))
    vocab = len(tokenizer)
    constraints.check(got_rows, blocked, 3, vocab, got_rows)
    for m, unpacked in zip(rows, blocked, strict=True):
        assert (~unpacked[:vocab].numpy() == allowed(m)[:vocab]).all()


# the property: masks allow every valid instance of the tested subset, and it validates
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=SCHEMAS)
def test_every_instance_of_a_random_schema_is_allowed_token_by_token(grammars, tokenizer, drawn):
    schema, instance = drawn
    jsonschema.validate(instance, schema)
    m = matcher(grammars, tokenizer, "json_schema", json.dumps(schema))
    walk(m, tokenizer, text(instance))
    assert m.stopped or allowed(m)[tokenizer.eos_token_id], "a complete instance may end"
