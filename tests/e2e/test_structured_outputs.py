"""Constrained decoding through the official `openai` client against the real stack (the session's float32
stack of the real model): response_format with chat.completions.parse and a pydantic model, json_object,
regex and choice through extra_body (vLLM's structured_outputs and guided_* names), completions, streaming;
with sampling controls, n samples, stop strings, max_tokens and the prefix cache; refusals, quick and
without effect on other requests."""

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.e2e
ASK = [{"role": "user", "content": "Describe a famous scientist as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "born": {"type": "integer", "minimum": 1000, "maximum": 2025},
        "fields": {"type": "array", "items": {"enum": ["physics", "chemistry", "biology"]}, "maxItems": 3},
    },
    "required": ["name", "born", "fields"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


class Scientist(BaseModel):
    name: str
    born: int
    alive: bool


def salt() -> dict:
    return {"cache_salt": uuid.uuid4().hex}


def person(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    return value


def test_parse_with_a_pydantic_model_returns_the_model(api, model):
    completion = api.chat.completions.parse(
        model=model, messages=ASK, response_format=Scientist, max_tokens=100, temperature=1.0, seed=1
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert (
        isinstance(message.parsed, Scientist)
        and Scientist.model_validate_json(message.content) == message.parsed
    )


def test_json_object_greedy_and_json_schema_at_temperature_one_streamed(api, model):
    # NOTE: greedy: any JSON object bounds no string, and at temperature 1 this model writes long ones.
    whole = api.chat.completions.create(
        model=model, messages=ASK, response_format={"type": "json_object"}, max_tokens=200, temperature=0
    )
    assert whole.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    chunks = list(
        api.chat.completions.create(
            model=model,
            messages=ASK,
            response_format=PERSON_FORMAT,
            max_tokens=120,
            temperature=1.0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    person(text)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_regex_and_choice_through_extra_body_under_both_names(api, model):
    for body in (
        {"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}},
        {"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
    ):
        done = api.completions.create(model=model, prompt="The date today:", max_tokens=20, extra_body=body)
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", done.choices[0].text), done.choices[0].text
        assert done.choices[0].finish_reason == "stop"
    question = [{"role": "user", "content": "Is the sky green? Answer yes or no."}]
    for body in (
        {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        {"guided_choice": ["yes", "no", "maybe"]},
    ):
        answer = api.chat.completions.create(model=model, messages=question, max_tokens=5, extra_body=body)
        assert answer.choices[0].message.content in ("yes", "no", "maybe")


def test_a_lark_grammar_and_completions_response_format(api, model):
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/'
    done = api.completions.create(
        model=model,
        prompt="Q: 6 times 7?\nA:",
        max_tokens=12,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"The answer is [1-9][0-9]?\.", done.choices[0].text)
    done = api.completions.create(
        model=model, prompt="A person:", max_tokens=120, extra_body={"response_format": PERSON_FORMAT}
    )
    person(done.choices[0].text)


@pytest.mark.parametrize(
    "controls",
    [
        {"temperature": 0.0},
        {"temperature": 1.3, "top_p": 0.9, "extra_body": {"top_k": 20, "min_p": 0.05}},
        {
            "temperature": 1.0,
            "presence_penalty": 1.5,
            "frequency_penalty": 1.0,
            "extra_body": {"repetition_penalty": 1.3},
        },
        {"temperature": 1.0, "logit_bias": {"90": 50, "28": -100}, "logprobs": True, "top_logprobs": 2},
    ],
)
def test_every_sampling_control_keeps_the_output_valid(api, model, controls):
    extra = {**controls.pop("extra_body", {}), **salt()}
    done = api.chat.completions.create(
        model=model, messages=ASK, response_format=PERSON_FORMAT, max_tokens=150, extra_body=extra, **controls
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    person(choice.message.content)
    if controls.get("logprobs"):
        assert len(choice.logprobs.content) == done.usage.completion_tokens


def test_n_seeded_samples_are_each_valid_and_reproducible(api, model):
    ask = dict(
        model=model, messages=ASK, response_format=PERSON_FORMAT, max_tokens=150, temperature=1.0, seed=7, n=3
    )
    first, again = api.chat.completions.create(**ask), api.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    for text in texts:
        person(text)
    assert texts == [c.message.content for c in again.choices], "same seed, same samples"
    assert len(set(texts)) > 1, "samples i draw with seed + i"


def test_max_tokens_truncates_with_length_and_a_stop_string_ends_early(api, model):
    cut = api.chat.completions.create(
        model=model, messages=ASK, response_format=PERSON_FORMAT, max_tokens=5, temperature=0
    )
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 5
    with pytest.raises(ValueError):
        json.loads(cut.choices[0].message.content)
    stopped = api.chat.completions.create(
        model=model,
        messages=ASK,
        response_format=PERSON_FORMAT,
        max_tokens=150,
        temperature=0,
        stop=['"born"'],
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].message.content.startswith(
        '{"name": '
    )
    assert '"born"' not in stopped.choices[0].message.content


def test_a_repeated_constrained_request_reuses_its_cached_prompt(api, model):
    ask = dict(
        model=model,
        messages=ASK * 4,
        response_format=PERSON_FORMAT,
        max_tokens=150,
        temperature=0,
        extra_body=salt(),
    )
    first, second = api.chat.completions.create(**ask), api.chat.completions.create(**ask)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message.content == second.choices[0].message.content
    person(second.choices[0].message.content)


DEEP: dict = {"type": "string"}
for _ in range(40):
    DEEP = {"type": "array", "items": DEEP}


def schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            schema_format({"type": "object", "if": {}}),
            'json_schema is not supported: Unimplemented keys: ["if"]',
        ),
        (schema_format(DEEP), "nested 41 levels deep"),
        (schema_format({"description": "x" * 70_000}), "--max-constraint-bytes"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "unclosed group"),
        ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, 'unknown name: "undefined_rule"'),
        ({"extra_body": {"guided_choice": []}}, "at least one choice"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}},
            "ignore_eos cannot",
        ),
    ],
)
def test_bad_constraints_are_refused_quickly_with_400_naming_the_problem(api, model, body, says):
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=model, messages=ASK, max_tokens=20, **body)
    assert time.monotonic() - start < 5
    assert says in caught.value.body["message"], caught.value.body


def test_refusals_leave_other_requests_unchanged(api, model):
    ask = dict(
        model=model,
        messages=ASK,
        response_format=PERSON_FORMAT,
        max_tokens=150,
        temperature=0,
        extra_body=salt(),
    )
    before = api.chat.completions.create(**ask).choices[0].message.content
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}

    def refused(_):
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(model=model, messages=ASK, max_tokens=20, response_format=bad)

    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(api.chat.completions.create, **ask)
        list(pool.map(refused, range(6)))
        assert running.result().choices[0].message.content == before
