"""The public edge's limits, each at its edge (accepted) and one past it (refused, naming the limit, the
value and the flag); the flags and docs/security.md agree with the declaration; every float control is
finite."""

import argparse
import math
import re
from dataclasses import fields

import grpc
import pytest

from common.errors import InvalidArgument, ResourceExhausted
from common.sampling_controls import CONTROLS, Kind
from gateway.limits import (
    PROMPT_BYTES_PER_TOKEN,
    EdgeLimits,
    add_limits,
    check_queue,
    check_request,
    check_request_id,
    table,
)
from gateway.sampling import resolve_sampling
from protos import generation_pb2
from tests.helpers import ROOT

MAX_MODEL_LEN = 512
LIMITS = EdgeLimits(
    max_prompt_bytes=64,
    max_messages=3,
    max_stop_bytes=8,
    max_stop_token_ids=4,
    max_logit_bias=5,
    max_cache_salt_bytes=10,
    max_request_id_bytes=12,
)


def request(**fields) -> generation_pb2.GenerateRequest:
    sampling = fields.pop("sampling", {})
    return generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(**sampling), **fields)


def messages(count: int, content: str = "x") -> list[generation_pb2.ChatMessage]:
    return [generation_pb2.ChatMessage(role="user", content=content) for _ in range(count)]


# (what, the request at the limit, the request one past it, the text the refusal carries)
EDGES = [
    ("prompt", dict(prompt="p" * 64), dict(prompt="p" * 65), "prompt has at least 65 bytes; the limit is 64"),
    ("prompt in UTF-8 bytes", dict(prompt="é" * 32), dict(prompt="é" * 32 + "e"), "--max-prompt-bytes"),
    ("messages", dict(messages=messages(3)), dict(messages=messages(4)),
     "messages has 4 entries; the limit is 3 (--max-messages)"),
    (
        "messages' bytes",
        dict(messages=messages(2, "c" * 28)),
        dict(messages=messages(2, "c" * 29)),
        "messages (roles and contents) has at least 66 bytes; the limit is 64 (--max-prompt-bytes)",
    ),
    ("stop", dict(sampling=dict(stop=["s" * 8])), dict(sampling=dict(stop=["ok", "s" * 9])),
     "sampling.stop[1] has at least 9 bytes; the limit is 8 (--max-stop-bytes)"),
    ("stop_token_ids", dict(sampling=dict(stop_token_ids=[1] * 4)),
     dict(sampling=dict(stop_token_ids=[1] * 5)),
     "sampling.stop_token_ids has 5 entries; the limit is 4 (--max-stop-token-ids)"),
    ("logit_bias", dict(sampling=dict(logit_bias={i: 1.0 for i in range(5)})),
     dict(sampling=dict(logit_bias={i: 1.0 for i in range(6)})),
     "sampling.logit_bias has 6 entries; the limit is 5 (--max-logit-bias)"),
    ("cache_salt", dict(cache_salt="s" * 10), dict(cache_salt="s" * 11),
     "cache_salt has at least 11 bytes; the limit is 10 (--max-cache-salt-bytes)"),
    ("token_ids", dict(token_ids=[1] * (MAX_MODEL_LEN - 1)), dict(token_ids=[1] * MAX_MODEL_LEN),
     f"the model takes at most {MAX_MODEL_LEN - 1}"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "edge", "past", "message"), EDGES, ids=[e[0] for e in EDGES])
def test_each_limit_takes_its_edge_and_refuses_one_past(what, edge, past, message):
    check_request(request(**edge), LIMITS, MAX_MODEL_LEN)
    with pytest.raises(InvalidArgument) as err:
        check_request(request(**past), LIMITS, MAX_MODEL_LEN)
    assert message in str(err.value)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_the_request_id_takes_its_limit():
    check_request_id("r" * 12, LIMITS)
    with pytest.raises(
        InvalidArgument, match=r"request_id has at least 13 bytes; the limit is 12 \(--max-request-id"
    ):
        check_request_id("r" * 13, LIMITS)


def test_the_default_prompt_limit_follows_the_context_length():
    limits = EdgeLimits()
    edge = PROMPT_BYTES_PER_TOKEN * MAX_MODEL_LEN
    assert limits.prompt_bytes(MAX_MODEL_LEN) == edge
    check_request(request(prompt="p" * edge), limits, MAX_MODEL_LEN)
    with pytest.raises(InvalidArgument, match=f"at least {edge + 1} bytes; the limit is {edge}"):
        check_request(request(prompt="p" * (edge + 1)), limits, MAX_MODEL_LEN)


def test_the_queue_takes_requests_up_to_its_length():
    check_queue(LIMITS.max_waiting - 1, LIMITS)
    with pytest.raises(ResourceExhausted, match=r"256 requests wait .* the limit is 256 \(--max-waiting\)"):
        check_queue(LIMITS.max_waiting, LIMITS)


def test_every_limit_is_a_flag_with_its_default():
    parser = argparse.ArgumentParser()
    add_limits(parser)
    assert EdgeLimits.from_args(parser.parse_args([])) == EdgeLimits()
    argv = [arg for f in fields(EdgeLimits) for arg in (f"--{f.name.replace('_', '-')}", "7")]
    sevens = EdgeLimits(**{f.name: 7 for f in fields(EdgeLimits)})
    assert EdgeLimits.from_args(parser.parse_args(argv)) == sevens
    for flag in ("--max-waiting", "--max-streams-per-key"):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-logit-bias", "-1"])
    assert parser.parse_args(["--max-logit-bias", "0"]).max_logit_bias == 0


def test_the_security_page_lists_every_limit_with_its_default_flag_and_code():
    section = (ROOT / "docs" / "security.md").read_text().split("## Public edge", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    for _, default, flag, code in table():
        row = next((row for row in rows if f"| `{flag}` |" in row), None)
        assert row is not None and re.search(rf"\| {default}\b.*\| {code} \|$", row), (flag, row)


FLOATS = [c.name for c in CONTROLS.values() if c.kind is Kind.FLOAT]


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_control_must_be_finite(name, value):
    with pytest.raises(InvalidArgument, match=f"sampling.{name} must be"):
        resolve_sampling(generation_pb2.SamplingParams(**{name: value}), 256)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_logit_bias_must_be_finite(value):
    with pytest.raises(InvalidArgument, match=r"sampling.logit_bias\[3\]"):
        resolve_sampling(generation_pb2.SamplingParams(logit_bias={3: value}), 256)


def test_every_float_field_of_the_public_api_is_a_checked_control():
    """SamplingParams' float fields are the FLOAT controls above (logit_bias's values: the test before)."""
    descriptor = generation_pb2.SamplingParams.DESCRIPTOR
    floats = {f.name for f in descriptor.fields if f.type in (f.TYPE_FLOAT, f.TYPE_DOUBLE)}
    assert floats == set(FLOATS)
    request_floats = [
        f.name for f in generation_pb2.GenerateRequest.DESCRIPTOR.fields if f.type == f.TYPE_FLOAT
    ]
    assert request_floats == []
