"""The sampling controls' one declaration holds everywhere: both protos, the resolved defaults, gateway and
compute validation at every range's edges (NaN and infinities refused), the SDK, the CLI and the docs."""

import argparse
import inspect
import math
import re
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from cli import generate as cli_generate
from common.errors import InvalidArgument
from common.sampling_controls import CONTROLS, ROW_CONTROLS, Control, Kind, read
from compute_service.validation import Limits, Sent, check_sent
from gateway.sampling import resolve_sampling
from gateway.sequence import Sampling
from protos import compute_pb2, generation_pb2
from sdk.client import Client
from tests.forward import forward_request

VOCAB = 100
LIMITS = Limits(vocab_size=VOCAB, max_model_len=64, num_blocks=8, block_size=4)
NUMBERS = [c for c in CONTROLS.values() if c.kind in (Kind.INT, Kind.FLOAT)]
FLOATS = [c.name for c in CONTROLS.values() if c.kind is Kind.FLOAT] + ["logit_bias"]
CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def edges(control: Control, numeric: bool = False) -> list[tuple[float, bool]]:
    """(value, accepted) just at and just past each end of the control's range."""
    bounds = control.range.numeric() if numeric else control.range
    step = 1 if control.kind is Kind.INT else 1e-3
    high = CONTROLS[bounds.high].default if isinstance(bounds.high, str) else bounds.high
    out = []
    for end, is_open, outward in ((bounds.low, bounds.low_open, -1), (high, bounds.high_open, 1)):
        if end is not None:
            out += [(end, not is_open), (end + outward * step, False), (end - outward * step, True)]
    return out


def gateway_cases() -> list:
    cases = [(c.name, value, ok) for c in NUMBERS for value, ok in edges(c)]
    bias = CONTROLS["logit_bias"]
    cases += [("logit_bias", {5: value}, ok) for value, ok in edges(bias)]
    return cases


def compute_cases() -> list:
    cases = [(c.name, value, ok) for c in ROW_CONTROLS if c.kind in (Kind.INT, Kind.FLOAT)
             for value, ok in edges(c, numeric=True)]  # fmt: skip
    cases += [("logit_bias", {5: value}, ok) for value, ok in edges(CONTROLS["logit_bias"])]
    return cases


def not_finite() -> list:
    return [(name, value) for name in FLOATS for value in (math.nan, math.inf, -math.inf)]


def as_field(name: str, value):
    return {name: {5: value}} if name == "logit_bias" and not isinstance(value, dict) else {name: value}


# declaration <-> protos and the resolved Sampling
def test_the_public_message_holds_every_control_and_reads_unset_as_the_default():
    params = generation_pb2.SamplingParams()
    assert sorted(f.name for f in params.DESCRIPTOR.fields) == sorted(CONTROLS)
    assert {name: read(params, c) for name, c in CONTROLS.items()} == {
        n: c.default for n, c in CONTROLS.items()
    }


def test_the_row_message_holds_the_row_controls_and_reads_unset_as_the_default():
    row = compute_pb2.RowSampling()
    assert sorted(f.name for f in row.DESCRIPTOR.fields) == sorted(
        [c.name for c in ROW_CONTROLS] + ["suppress_token_ids"]
    )
    assert all(read(row, c) == c.default for c in ROW_CONTROLS)


def test_the_resolved_sampling_has_the_declared_fields_and_defaults():
    assert [f.name for f in fields(Sampling)] == list(CONTROLS)
    assert all(getattr(Sampling(), name) == c.default for name, c in CONTROLS.items())
    assert resolve_sampling(generation_pb2.SamplingParams(), VOCAB) == Sampling()


# gateway validation
@pytest.mark.parametrize(("name", "value", "accepted"), gateway_cases())
def test_the_gateway_accepts_each_range_edge_and_refuses_past_it(name, value, accepted):
    params = generation_pb2.SamplingParams(**as_field(name, value))
    if accepted:
        assert getattr(resolve_sampling(params, VOCAB), name) == pytest.approx(getattr(params, name))
        return
    with pytest.raises(InvalidArgument, match=rf"^sampling\.{name}"):
        resolve_sampling(params, VOCAB)


@pytest.mark.parametrize(("name", "value"), not_finite())
def test_the_gateway_refuses_nan_and_infinities_naming_the_field(name, value):
    with pytest.raises(InvalidArgument) as err:
        resolve_sampling(generation_pb2.SamplingParams(**as_field(name, value)), VOCAB)
    assert str(err.value).startswith(f"sampling.{name}")
    assert CONTROLS[name].allowed().split(" (")[0] in str(err.value)


def test_gateway_messages_give_the_range_and_what_is_off():
    with pytest.raises(InvalidArgument) as err:
        resolve_sampling(generation_pb2.SamplingParams(top_p=0.0), VOCAB)
    assert str(err.value) == "sampling.top_p must be in (0, 1] (1.0 is off), got 0.0"
    with pytest.raises(InvalidArgument) as err:
        resolve_sampling(generation_pb2.SamplingParams(max_tokens=4, min_tokens=5), VOCAB)
    assert str(err.value) == "sampling.min_tokens must be in [0, max_tokens = 4] (0 is off), got 5"


# compute validation
def step(name: str, value) -> Sent:
    request = forward_request([[1, 2, 3], [4]], [0, 0], [[0], [1]], block_size=4)
    request.sampling[1].CopyFrom(compute_pb2.RowSampling(**as_field(name, value)))
    request.output_lens.extend([0, 0])
    return Sent.from_request(request)


@pytest.mark.parametrize(("name", "value", "accepted"), compute_cases())
def test_compute_accepts_each_range_edge_and_refuses_past_it(name, value, accepted):
    if accepted:
        check_sent(step(name, value), LIMITS)
        return
    with pytest.raises(InvalidArgument, match=rf"^sampling\[1\]\.{name}"):
        check_sent(step(name, value), LIMITS)


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, v in not_finite() if CONTROLS[n] in ROW_CONTROLS])
def test_compute_refuses_nan_and_infinities_naming_the_field(name, value):
    with pytest.raises(InvalidArgument, match=rf"^sampling\[1\]\.{name}.* is invalid"):
        check_sent(step(name, value), LIMITS)


# the SDK, the CLI and the docs
def test_the_sdk_takes_exactly_the_declared_controls():
    build_request = sys.modules[Client.__module__].build_request
    params = inspect.signature(build_request).parameters
    other = {"prompt", "token_ids", "messages", "request_id", "cache_salt", "priority"}
    # constrained decoding and tools (docs/structured-outputs.md, docs/tool-calling.md)
    other |= {"json_schema", "json_object", "regex", "choice", "grammar", "tools", "tool_choice"}
    other |= {"parallel_tool_calls"}
    other |= {"sparse_attention"}  # the attention a request's decodes use (docs/sparse-attention.md)
    other |= {"prompts"}  # several prompts in one request (docs/api.md)
    other |= {"chat_template_kwargs"}  # variables for the chat template (docs/reasoning.md)
    other |= {"lora_adapter"}  # the LoRA adapter the request runs (docs/adapters.md)
    assert sorted(set(params) - other) == sorted(CONTROLS)
    for name, control in CONTROLS.items():
        default = params[name].default
        assert default is None or default == control.default or not default and not control.default, name


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_generate.add_parser(parser.add_subparsers())
    return parser.parse_args(["generate", "hi", *argv])


def test_the_cli_has_one_flag_per_control_and_sends_only_those_given():
    assert cli_generate.sampling_kwargs(parse()) == {"max_tokens": 64}
    given = cli_generate.sampling_kwargs(
        parse("--temperature", "0", "--top-k", "0", "--logit-bias", "5=-100", "--logit-bias", "6=1",
              "--stop", ",", "--stop-token-id", "7", "--ignore-eos", "--seed", "3", "--logprobs", "2",
              "--min-p", "0.1", "--top-p", "0.9", "--repetition-penalty", "1.2", "--presence-penalty", "1",
              "--frequency-penalty", "-1", "--min-tokens", "2", "--max-tokens", "8",
                  "--prompt-logprobs", "1")
    )  # fmt: skip
    assert sorted(given) == sorted(set(CONTROLS) - {"n"})
    assert (given["temperature"], given["top_k"], given["logit_bias"]) == (0.0, 0, {5: -100.0, 6: 1.0})
    build_request = sys.modules[Client.__module__].build_request
    sampling = resolve_sampling(build_request("hi", **given).sampling, VOCAB)
    assert (sampling.temperature, sampling.stop, sampling.stop_token_ids) == (0.0, (",",), frozenset({7}))


def docs_table() -> str:
    def default(c: Control) -> str:
        if c.default is None or c.kind in (Kind.TOKEN_IDS, Kind.TOKEN_BIAS, Kind.STRINGS):
            return "none"
        if c.kind is Kind.FLAG:
            return str(c.default).lower()
        return f"{c.default} (off)" if c.default == c.off else str(c.default)

    rows = [f"| `{c.name}` | {default(c)} | {c.range_text()} | {c.help} |" for c in CONTROLS.values()]
    return "\n".join(["| control | default | range | meaning |", "|---|---|---|---|", *rows])


def test_the_docs_table_is_the_declaration():
    section = re.search(r"## Sampling and stopping\n\n(\|.*?)\n\n", CONFIGURATION.read_text(), re.S)
    assert section, "docs/configuration.md has no '## Sampling and stopping' table"
    assert section.group(1) == docs_table(), f"replace docs/configuration.md's table with:\n{docs_table()}"
