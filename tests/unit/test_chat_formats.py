"""The gateway's reasoning and tool-call formats (gateway/reasoning, gateway/tools): each parser fed a model's
real output in pieces of every size gives the same split and never releases part of a call or a tag as
text; each format's grammar (run in the real grammar engine) accepts the model's own format and no prose;
the format a chat template implies."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.model_files import local_copy
from gateway.reasoning import formats as reasoning_formats
from gateway.reasoning.constraint import after_reasoning
from gateway.reasoning.split import ReasoningSplit
from gateway.structured.grammars import Grammars
from gateway.structured.lark import Tags
from gateway.structured.limits import ConstraintLimits
from gateway.structured.spec import Spec
from gateway.tools import formats as tool_formats
from tests.scripted_model import family_tokenizer

TEMPLATES = Path(__file__).parent.parent / "chat_templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}  # fmt: skip
FUNCTIONS = [("get_weather", WEATHER), ("get_time", {"type": "object", "properties": {}})]
PARIS = ("get_weather", {"city": "Paris", "days": 2})
# A model's output in each format: text, then the calls it holds, then the content around them.
OUTPUTS = {
    "hermes": (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        "\n</tool_call>",
        [PARIS],
        "Sure.\n",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
        '{"name": "get_time", "parameters": {}}',
        [PARIS, ("get_time", {})],
        "",
    ),
    "mistral": (
        'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {}}]',
        [PARIS, ("get_time", {})],
        "Let me check.",
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
        "2\n</parameter>\n</function>\n</tool_call>",
        [PARIS],
        "",
    ),
    "pythonic": ("[get_weather(city='Paris', days=2), get_time()]", [PARIS, ("get_time", {})], ""),
}


def run(parser, text: str, size: int) -> tuple[str, list]:
    content, calls = "", []
    for start in range(0, len(text), size):
        part, found = parser.feed(text[start : start + size])
        content, calls = content + part, calls + found
    part, found = parser.finish()
    return content + part, calls + found


@pytest.mark.parametrize("name", OUTPUTS)
def test_each_format_parses_its_models_output_however_it_streams(name):
    text, calls, content = OUTPUTS[name]
    fmt = tool_formats.FORMATS[name]
    for size in (1, 2, 3, 7, len(text)):
        parser = fmt.parser(dict(FUNCTIONS))
        got, found = run(parser, text, size)
        assert got == content, (size, got)
        assert [(c.name, json.loads(c.arguments)) for c in found] == calls, size


@pytest.mark.parametrize("name", OUTPUTS)
def test_text_that_is_no_call_stays_text(name):
    fmt = tool_formats.FORMATS[name]
    for text in ("The weather is fine.", "[1, 2] are numbers", "{not json"):
        assert run(fmt.parser({}), text, 1) == (text, []), text


def test_mistral_ids_are_nine_letters_and_digits():
    _, (call, _) = run(tool_formats.FORMATS["mistral"].parser({}), OUTPUTS["mistral"][0], 5)
    assert len(call.id) == 9 and call.id.isalnum()


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer(AutoTokenizer.from_pretrained(local_copy("smollm2").path), "qwen3")


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, ConstraintLimits())


def accepts(grammars, tokenizer, spec: Spec, text: str) -> bool:
    matcher = grammars.matcher(spec, len(tokenizer), [tokenizer.eos_token_id])
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not (matcher.mask().view("uint32")[token // 32] >> (token % 32)) & 1:
            return False
        matcher.accept(token)
    return True


@pytest.mark.parametrize("name", OUTPUTS)
def test_each_formats_grammar_accepts_its_own_calls_and_no_prose(grammars, tokenizer, name):
    prose = {"hermes": "Sure.\n", "mistral": "Let me check.", "llama3_json": "<|python_tag|>"}
    text = OUTPUTS[name][0].removeprefix(prose.get(name, ""))
    spec = Spec("lark", tool_formats.FORMATS[name].grammar(FUNCTIONS, True, Tags.of(tokenizer)))
    assert accepts(grammars, tokenizer, spec, text)
    assert not accepts(grammars, tokenizer, spec, "It is sunny.")


@pytest.mark.parametrize(
    ("text", "opened", "split"),
    [
        ("<think>\nI reason.\n</think>\n\nThe answer.", False, ("I reason.", "The answer.")),
        ("The answer <think>x</think>", False, ("", "The answer <think>x</think>")),
        ("I reason.</think>The answer.", True, ("I reason.", "The answer.")),
        ("<think>I reason.</think>The answer.", True, ("I reason.", "The answer.")),
        ("<think> cut short by max_tokens", False, ("cut short by max_tokens", "")),
    ],
)
def test_the_reasoning_splits_however_the_text_streams(text, opened, split):
    fmt = reasoning_formats.FORMATS["qwen3"]
    for size in (1, 2, 5, len(text)):
        splitter, got = ReasoningSplit(fmt, opened), ["", ""]
        for start in range(0, len(text), size):
            for i, part in enumerate(splitter.feed(text[start : start + size])):
                got[i] += part
        for i, part in enumerate(splitter.finish()):
            got[i] += part
        assert tuple(got) == split, size


@pytest.mark.parametrize("opened", [False, True])
def test_a_constraint_holds_after_the_reasoning_only(grammars, tokenizer, opened):
    schema = Spec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                              "required": ["a"], "additionalProperties": False}))  # fmt: skip
    spec = after_reasoning(schema, reasoning_formats.FORMATS["qwen3"], opened, Tags.of(tokenizer))
    head = "" if opened else "<think>"
    assert accepts(grammars, tokenizer, spec, head + 'Free text, {not json}.</think>\n\n{"a": 1}')
    assert not accepts(grammars, tokenizer, spec, head + "Free text.</think>Prose.")
    if not opened:
        assert accepts(grammars, tokenizer, spec, '{"a": 1}'), "a model may answer without reasoning"


@pytest.mark.parametrize(
    ("family", "tools", "reasoning"),
    [
        ("qwen3", "hermes", "qwen3"),
        ("deepseek_r1", "hermes", "qwen3"),
        ("llama3_json", "llama3_json", None),
        ("llama3_pythonic", "pythonic", None),
        ("mistral", "mistral", None),
        ("qwen3_coder", "qwen3_coder", None),
    ],
)
def test_auto_reads_the_formats_from_the_template(family, tools, reasoning):
    template = (TEMPLATES / f"{family}.jinja").read_text()
    assert tool_formats.choose("auto", template, renders_tools=True).name == tools
    found = reasoning_formats.choose("auto", template)
    assert (found and found.name) == reasoning
    assert tool_formats.choose("auto", template, renders_tools=False).name == "hermes"
    with pytest.raises(ValueError, match="renders no tools"):
        tool_formats.choose("mistral", template, renders_tools=False)
