"""Constrained decoding over gRPC, the SDK and `pagedserve generate` against the real stack: each kind of
constraint, refusals as INVALID_ARGUMENT, unconstrained requests whose tokens a constrained one beside them
leaves unchanged (with multi-step decoding on), matcher state across preemption and recompute (the small
stack), and the property: outputs for random schemas of the tested subset, sampled at temperature 1, parse
and validate."""

import json
import re
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings

from sdk.client import GenerationError
from tests.e2e.greedy import TIE, assert_greedy_equal
from tests.e2e.stack import preemptions
from tests.helpers import PAGEDSERVE
from tests.structured_schemas import SCHEMAS

pytestmark = pytest.mark.e2e
LIST = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 3, "maxItems": 5}
    },
    "required": ["items"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "List some fruits as JSON."}]


@pytest.fixture(scope="module")
def client(stack_fp32):
    with stack_fp32.client(timeout=300) as client:
        yield client


def test_every_kind_of_constraint_through_the_sdk(client):
    done = client.generate(messages=CHAT, json_schema=LIST, max_tokens=150, temperature=1.0, seed=5)
    assert done.finish_reason == "stop"
    jsonschema.validate(json.loads(done.text), LIST)
    assert json.loads(client.generate(messages=CHAT, json_object=True, max_tokens=150, temperature=0).text)
    date = client.generate(prompt="Today is", regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}", max_tokens=20)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text) and date.finish_reason == "stop"
    colour = client.generate(prompt="My favourite colour is", choice=["red", "green", "blue"], max_tokens=5)
    assert colour.text in ("red", "green", "blue")
    counted = client.generate(prompt="Count:", grammar='root ::= "1, 2, " [3-9]', max_tokens=10)
    assert re.fullmatch(r"1, 2, [3-9]", counted.text)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"json_schema": {"type": "object", "if": {}}}, 'Unimplemented keys: ["if"]'),
        ({"json_schema": "{not json"}, "constraint.json_schema is not valid JSON"),
        ({"regex": "(a"}, "unclosed group"),
        ({"choice": ["x", ""]}, "none of them empty"),
        ({"tools": [{"name": ""}], "messages": CHAT}, "tools[0] has no name"),
    ],
)
def test_bad_constraints_are_invalid_argument(client, kwargs, says):
    kwargs.setdefault("prompt", None if "messages" in kwargs else "hi")
    with pytest.raises(GenerationError) as caught:
        client.generate(max_tokens=5, **kwargs)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and says in caught.value.details


def generate(stack, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PAGEDSERVE, "generate", *flags, "--temperature", "0", "--target", stack.target],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_pagedserve_generate_takes_a_schema_file_a_regex_and_choices(stack_fp32, tmp_path):
    schema = tmp_path / "list.json"
    schema.write_text(json.dumps(LIST))
    listed = generate(
        stack_fp32, "List some fruits.", "--json-schema", str(schema), "--max-tokens", "150", "--chat"
    )
    assert listed.returncode == 0, listed.stderr
    jsonschema.validate(json.loads(listed.stdout), LIST)
    named = generate(stack_fp32, "A name:", "--regex", "[A-Z][a-z]+", "--max-tokens", "10")
    assert named.returncode == 0 and re.fullmatch(r"[A-Z][a-z]+", named.stdout.rstrip("\n")), named.stdout
    side = generate(stack_fp32, "Turn", "--choice", "left", "--choice", "right")
    assert side.returncode == 0 and side.stdout.rstrip("\n") in ("left", "right"), side.stdout
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    unread = generate(stack_fp32, "hi", "--json-schema", str(broken))
    assert unread.returncode == 2 and "cannot read" in unread.stderr
    refused = generate(stack_fp32, "hi", "--regex", "(")
    assert (
        refused.returncode == 1
        and "INVALID_ARGUMENT" in refused.stderr
        and "unclosed group" in refused.stderr
    )


def test_a_constrained_request_beside_unconstrained_ones_leaves_their_tokens_unchanged(client):
    prompts = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):"]
    plain = dict(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = [client.generate(prompt=p, cache_salt=uuid.uuid4().hex, **plain) for p in prompts]
    with ThreadPoolExecutor(len(prompts) + 2) as pool:
        constrained = [
            pool.submit(
                client.generate, messages=CHAT, json_schema=LIST, max_tokens=150, temperature=1.0, seed=s
            )
            for s in range(2)
        ]
        beside = [
            pool.submit(client.generate, prompt=p, cache_salt=uuid.uuid4().hex, **plain) for p in prompts
        ]
        for future in constrained:
            jsonschema.validate(json.loads(future.result().text), LIST)
        for reference, future in zip(alone, beside, strict=True):
            gaps = [lp.top[0][1] - lp.top[1][1] for lp in reference.logprobs]
            assert_greedy_equal(future.result().token_ids, reference.token_ids, gaps, TIE)


def test_matchers_survive_preemption_and_recompute(small_stack):
    before = preemptions(small_stack)
    long_list = {
        **LIST,
        "properties": {"items": {**LIST["properties"]["items"], "minItems": 6, "maxItems": 8}},
    }
    with small_stack.client(timeout=600) as client, ThreadPoolExecutor(8) as pool:
        ask = dict(messages=CHAT, json_schema=long_list, max_tokens=250, temperature=1.0)
        futures = [pool.submit(client.generate, **ask, seed=s, cache_salt=uuid.uuid4().hex) for s in range(8)]
        results = [f.result() for f in futures]
    assert preemptions(small_stack) > before, "24 blocks are meant to run out"
    for result in results:
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), long_list)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=SCHEMAS)
def test_random_schemas_sampled_at_temperature_one_parse_and_validate(client, drawn):
    schema, _ = drawn
    prompt = f"Write a JSON value for this schema: {json.dumps(schema)}"
    samples = client.generate_n(messages=[{"role": "user", "content": prompt}], n=2, json_schema=schema,
                                max_tokens=400, temperature=1.0)  # fmt: skip
    for sample in samples:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), schema)
