"""Reasoning and tool-call formats end to end, in the real formats of eight model families: one cache and
compute serving a scripted tiny model (tests/scripted_model.py: greedy, it writes `<think>Let me
think.</think>{"answer": 42}` after a generation prompt, an analysis then a final harmony message after
gpt-oss's, `[THINK]...[/THINK]` then the answer after Magistral's), and one gateway per family's chat
template (tests/chat_templates), each choosing its parsers from its template (pythonic by flag, as vLLM's).
Forced calls are written by constrained decoding in each family's format, parsed back by the gateway while
they stream, and fed back through the family's template."""

import json
import subprocess

import anthropic
import httpx
import openai
import pytest

from sdk.client import Client
from tests.helpers import PAGEDSERVE, ROOT, free_port, start, stop, wait_healthy
from tests.scripted_model import HARMONY_FINAL, save_family, save_scripted_model

pytestmark = pytest.mark.e2e
GATEWAY_SERVICE = "pagedserve.v1.Generation"
REASONING, ANSWER = "Let me think.", '{"answer": 42}'
# gpt-oss's harmony output after its generation prompt (`<|start|>assistant`, whose last token is `istant`),
# token by token, into the answer the first chain writes.
HARMONY_REASONING = "Which city?"
HARMONY = ["istant", "<|channel|>", "analysis", "<|message|>", "Which", " city", "?", "<|end|>", "<|start|>",
           HARMONY_FINAL, '{"']  # fmt: skip
# Magistral's output after its prompt's last token, `[/INST]`.
MAGISTRAL_REASONING = "Weather lookup"
MAGISTRAL = ["[/INST]", "[THINK]", "Weather", " lookup", "[/THINK]", '{"']
SCRIPT = ['\n<think>Let me think.</think>{"answer": 42}<|im_end|>', ["\n\n", '{"'], HARMONY, MAGISTRAL]
# family -> the gateway's extra flags
FAMILIES = {
    "qwen3": (), "deepseek_r1": (), "llama3_json": (), "mistral": (), "qwen3_coder": (),
    "llama3_pythonic": ("--tool-call-parser", "pythonic"), "harmony": (), "magistral": (),
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
GREEDY = {"temperature": 0, "max_tokens": 80}
# The families with a reasoning format, and the reasoning the script writes in theirs.
REASONING_FAMILIES = [
    ("qwen3", REASONING),
    ("deepseek_r1", REASONING),
    ("harmony", HARMONY_REASONING),
    ("magistral", MAGISTRAL_REASONING),
]


@pytest.fixture(scope="module")
def gateways(tmp_path_factory, tokenizer):
    """family -> (HTTP URL, gRPC target) of its gateway."""
    models, logs = tmp_path_factory.mktemp("models"), tmp_path_factory.mktemp("logs")
    model = save_scripted_model(models / "scripted", tokenizer, SCRIPT)
    ports = {name: free_port() for name in ("cache", "compute")}
    procs: list[subprocess.Popen] = []
    try:
        for name, argv in (("cache", ["cache_service", "--kv-blocks", "256"]),
                           ("compute", ["compute_service", "--model", str(model), "--dtype", "float32",
                                        "--threads", "1"])):  # fmt: skip
            procs.append(
                start(*argv, "--port", str(ports[name]), "--insecure", log_path=logs / f"{name}.log")
            )
        for name, proc in zip(ports, procs, strict=True):
            wait_healthy(f"127.0.0.1:{ports[name]}", proc, 120)
        found = {}
        for family, flags in FAMILIES.items():
            path = save_family(models / family, tokenizer, family, model)
            grpc_port, http_port = free_port(), free_port()
            procs.append(start(
                "gateway", "--model", str(path), "--port", str(grpc_port), "--http-port", str(http_port),
                "--cache-target", f"127.0.0.1:{ports['cache']}", "--compute-target",
                f"127.0.0.1:{ports['compute']}", *flags, log_path=logs / f"gateway-{family}.log",
            ))  # fmt: skip
            found[family] = (f"http://127.0.0.1:{http_port}/v1", f"127.0.0.1:{grpc_port}")
        for (_, target), proc in zip(found.values(), procs[2:], strict=True):
            wait_healthy(target, proc, 120, GATEWAY_SERVICE)
        yield found
    finally:
        codes = [stop(proc) for proc in reversed(procs)]
    assert set(codes) == {0}, codes


def chat(gateways, family: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateways[family][0], api_key="unused", max_retries=0, timeout=120)


# reasoning
@pytest.mark.parametrize(("family", "reasoning"), REASONING_FAMILIES)
def test_the_reasoning_comes_apart_whole_and_streamed(gateways, family, reasoning):
    client = chat(gateways, family)
    whole = client.chat.completions.create(model="scripted", messages=ASK, **GREEDY).choices[0]
    assert (whole.message.reasoning_content, whole.message.content) == (reasoning, ANSWER)
    chunks = list(client.chat.completions.create(model="scripted", messages=ASK, stream=True, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert not any(getattr(d, "reasoning_content", None) and d.content for d in deltas), "deltas of their own"


def test_enable_thinking_false_reaches_the_template(gateways):
    client = chat(gateways, "qwen3")
    thinking = client.chat.completions.create(model="scripted", messages=ASK, **GREEDY)
    direct = client.chat.completions.create(
        model="scripted",
        messages=ASK,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **GREEDY,
    )
    message = direct.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content == ANSWER
    assert direct.usage.prompt_tokens > thinking.usage.prompt_tokens, "the empty think block is in the prompt"
    tokenize = gateways["qwen3"][0].removesuffix("/v1") + "/tokenize"
    for kwargs, expected in (({}, thinking), ({"enable_thinking": False}, direct)):
        body = {"messages": ASK, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        rendered = httpx.post(tokenize, json=body, timeout=60).json()
        assert rendered["count"] == expected.usage.prompt_tokens, "/tokenize renders as the chat does"
    with pytest.raises(
        openai.BadRequestError, match="chat_template_kwargs: Input should be a valid dictionary"
    ):
        client.chat.completions.create(
            model="scripted", messages=ASK, extra_body={"chat_template_kwargs": [1]}
        )


@pytest.mark.parametrize(("family", "reasoning"), REASONING_FAMILIES)
def test_a_schema_applies_to_the_answer_after_the_reasoning(gateways, family, reasoning):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    done = chat(gateways, family).chat.completions.create(
        model="scripted", messages=ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}, **GREEDY,
    )  # fmt: skip
    message = done.choices[0].message
    assert message.reasoning_content == reasoning, "the reasoning is the model's own, unconstrained"
    assert json.loads(message.content) == {"city": "Paris"}


@pytest.mark.parametrize(("family", "reasoning"), [("qwen3", REASONING), ("harmony", HARMONY_REASONING)])
def test_a_forced_call_follows_the_reasoning(gateways, family, reasoning):
    done = chat(gateways, family).chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        **GREEDY,
    )  # fmt: skip
    choice = done.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.message.reasoning_content == reasoning and choice.finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] in (
        "celsius",
        "fahrenheit",
    )


def test_reasoning_on_the_other_fronts(gateways):
    url, target = gateways["qwen3"]
    response = chat(gateways, "qwen3").responses.create(model="scripted", input="What?", max_output_tokens=40)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert response.output_text == ANSWER
    claude = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0)
    blocks = claude.messages.create(model="scripted", max_tokens=40, messages=ASK).content
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in blocks] == [
        ("thinking", REASONING),
        ("text", ANSWER),
    ]
    with Client(target, timeout=120) as client:
        done = client.generate(messages=ASK, max_tokens=40, temperature=0)
    assert (done.reasoning_text, done.text) == (REASONING, ANSWER)


# tool-call formats
@pytest.mark.parametrize(
    "family", ["llama3_json", "mistral", "qwen3_coder", "llama3_pythonic", "qwen3", "harmony"]
)
def test_calls_in_the_familys_format_stream_as_calls_and_go_back_through_its_template(gateways, family):
    client = chat(gateways, family)
    chunks = list(client.chat.completions.create(
        model="scripted", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        stream=True, **GREEDY,
    ))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks]
    assert not "".join(d.content or "" for d in deltas), "no part of the call is released as text"
    (call,) = [call for d in deltas for call in d.tool_calls or ()]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"}
    assert 1 <= len(arguments["city"]) <= 12 and arguments["unit"] in ("celsius", "fahrenheit")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    back = [*ASK, {"role": "assistant", "tool_calls": [call.model_dump(exclude={"index"})]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
    answer = client.chat.completions.create(model="scripted", messages=back, tools=[WEATHER], **GREEDY)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls"), (
        "the template took the call back"
    )


def test_the_cli_writes_the_reasoning_to_stderr_and_passes_template_variables(gateways):
    target = gateways["qwen3"][1]
    ask = [
        *PAGEDSERVE,
        "generate",
        "What?",
        "--chat",
        "--target",
        target,
        "--max-tokens",
        "40",
        "--temperature",
        "0",
    ]
    thinking = subprocess.run(ask, capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    assert thinking.stdout.strip() == ANSWER and thinking.stderr.startswith(REASONING)
    off = [*ask, "--chat-template-kwargs", '{"enable_thinking": false}']
    direct = subprocess.run(off, capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    assert direct.stdout.strip() == ANSWER and REASONING not in direct.stderr


# gpt-oss's harmony messages
def test_the_harmony_analysis_is_a_reasoning_item_of_a_response(gateways):
    client = chat(gateways, "harmony")
    response = client.responses.create(model="scripted", input="What?", max_output_tokens=40)
    reasoning, _ = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == HARMONY_REASONING
    assert response.output_text == ANSWER
