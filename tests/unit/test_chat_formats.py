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
from gateway.reasoning.harmony import HarmonySplit
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
    "openai": (
        "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
        [PARIS, ("get_time", {})],
        "Let me check.",
    ),
}
# gpt-oss's harmony output: its text, whether the prompt opened the analysis, then (reasoning, answer).
ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
HARMONY = [
    (f"{ANALYSIS}I reason.<|end|>{FINAL}The answer.<|return|>", False, ("I reason.", "The answer.")),
    (f"{ANALYSIS} I reason.<|end|>{FINAL}The answer.", False, ("I reason.", "The answer.")),
    ("<|channel|>final<|message|>The answer.<|end|>", False, ("", "The answer.")),
    (f"<|channel|>commentary<|message|>Checking.<|end|>{FINAL} Sunny.", False, ("", "Checking. Sunny.")),
    (f"I reason.<|end|>{FINAL}The answer.", True, ("I reason.", "The answer.")),
    (f"{ANALYSIS}I reason.{FINAL}The answer.", False, ("I reason.", "The answer.")),
    (f"{ANALYSIS}cut short by max_tokens", False, ("cut short by max_tokens", "")),
    (f"{ANALYSIS}I reason.<|end|><|start|>assistant<|channel|>fin", False,
     ("I reason.", "<|start|>assistant<|channel|>fin")),
    ("The answer, to=me, <|channel|> plain.", False, ("", "The answer, to=me, <|channel|> plain.")),
    (f"{ANALYSIS}Weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
     '<|message|>{"city": "Paris"}<|call|>', False,
     ("Weather.", '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>')),
]  # fmt: skip


def pieces(text: str) -> list[list[str]]:
    """The text in pieces of a few sizes, and cut in two at every place (inside every token's text)."""
    sized = [[text[at : at + size] for at in range(0, len(text), size)] for size in (1, 2, 3, 7, len(text))]
    return sized + [[text[:cut], text[cut:]] for cut in range(1, len(text))]


def run(parser, text: str, size: int) -> tuple[str, list]:
    return run_pieces(parser, [text[start : start + size] for start in range(0, len(text), size)])


def run_pieces(parser, parts: list[str]) -> tuple[str, list]:
    content, calls = "", []
    for part in parts:
        part, found = parser.feed(part)
        content, calls = content + part, calls + found
    part, found = parser.finish()
    return content + part, calls + found


@pytest.mark.parametrize("name", OUTPUTS)
def test_each_format_parses_its_models_output_however_it_streams(name):
    text, calls, content = OUTPUTS[name]
    fmt = tool_formats.FORMATS[name]
    for parts in pieces(text):
        got, found = run_pieces(fmt.parser(dict(FUNCTIONS)), parts)
        assert got == content, (parts, got)
        assert [(c.name, json.loads(c.arguments)) for c in found] == calls, parts


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


@pytest.mark.parametrize("name", [name for name in OUTPUTS if name != "openai"])
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
        ("harmony", "openai", "openai_gptoss"),
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


# gpt-oss's harmony format
@pytest.mark.parametrize(("text", "opened", "split"), HARMONY)
def test_the_harmony_analysis_splits_however_the_text_streams(text, opened, split):
    for parts in pieces(text):
        splitter, got = HarmonySplit(opened), ["", ""]
        for part in parts:
            for i, piece in enumerate(splitter.feed(part)):
                got[i] += piece
        for i, piece in enumerate(splitter.finish()):
            got[i] += piece
        assert tuple(got) == split, parts


def test_harmony_calls_are_read_from_the_answer_after_the_analysis():
    text, calls, content = OUTPUTS["openai"]
    whole = "<|channel|>analysis<|message|>Which city?<|end|><|start|>assistant" + text
    for parts in pieces(whole):
        splitter, parser = HarmonySplit(False), tool_formats.FORMATS["harmony"].parser({})
        reasoning, answer = "", ""
        for part in parts:
            more, rest = splitter.feed(part)
            reasoning, answer = reasoning + more, answer + rest
        more, rest = splitter.finish()
        got, found = run_pieces(parser, [answer + rest])
        assert (reasoning + more, got) == ("Which city?", content), parts
        assert [(c.name, json.loads(c.arguments)) for c in found] == calls


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par',
         '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par'),
        ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>not json<|call|>",
         "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>not json<|call|>"),
        ("<|channel|>commentary to=browser.search<|message|>{\"q\": \"x\"}<|call|>", '{"q": "x"}'),
        ("<|channel|>analysis<|message|>Unsplit.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
         "Unsplit.Done."),
    ],
)  # fmt: skip
def test_harmony_messages_that_are_no_call_are_content(text, content):
    for parts in pieces(text):
        got, found = run_pieces(tool_formats.FORMATS["openai"].parser({}), parts)
        assert (got, found) == (content, []), parts


def test_a_whole_harmony_call_the_output_ends_in_is_a_call():
    text = '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "UTC"}'
    _, (call,) = run(tool_formats.FORMATS["openai"].parser({}), text, 4)
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"zone": "UTC"})


@pytest.mark.parametrize("opened", [False, True])
def test_a_constraint_holds_in_the_final_message_after_the_analysis(grammars, tokenizer, opened):
    schema = Spec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                              "required": ["a"], "additionalProperties": False}))  # fmt: skip
    fmt = reasoning_formats.FORMATS["harmony"]
    spec = after_reasoning(schema, fmt, opened, Tags.of(tokenizer))
    head = "" if opened else "<|channel|>analysis<|message|>"
    final = '<|start|>assistant<|channel|>final<|message|>{"a": 1}'
    assert accepts(grammars, tokenizer, spec, head + "Free text, {not json}.<|end|>" + final)
    assert not accepts(
        grammars,
        tokenizer,
        spec,
        head + "Free text.<|end|><|start|>assistant<|channel|>final<|message|>Prose.",
    )
    if not opened:
        assert accepts(grammars, tokenizer, spec, '<|channel|>final<|message|>{"a": 1}'), "no analysis"


def test_a_forced_harmony_call_is_one_commentary_message(grammars, tokenizer):
    tags = Tags.of(tokenizer)
    call = Spec("lark", tool_formats.FORMATS["openai"].grammar(FUNCTIONS, True, tags))
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    assert accepts(grammars, tokenizer, call, text)
    assert not accepts(grammars, tokenizer, call, "<|channel|>final<|message|>It is sunny.")
    spec = after_reasoning(call, reasoning_formats.FORMATS["harmony"], False, tags, headed=True)
    assert accepts(
        grammars, tokenizer, spec, "<|channel|>analysis<|message|>Paris.<|end|><|start|>assistant" + text
    )
    assert accepts(grammars, tokenizer, spec, text), "no analysis"
