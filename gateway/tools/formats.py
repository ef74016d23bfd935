"""The tool-call formats the gateway reads and forces (--tool-call-parser, vLLM's names), and the one a chat
template implies (`auto`)."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gateway import harmony
from gateway.structured.lark import Tags
from gateway.tools import hermes, llama3_json, mistral, openai, pythonic, qwen3_coder
from gateway.tools.calls import Call


class CallParser(Protocol):
    def feed(self, text: str) -> tuple[str, list[Call]]: ...

    def finish(self) -> tuple[str, list[Call]]: ...


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model family writes calls: the grammar of forced calls (functions as (name, parameters schema),
    several or one), a parser per sample (given the functions' parameter schemas by name), and the tags it
    writes that a tokenizer may hold as special tokens (kept in the text for the parser). `channels`: its
    calls are harmony messages, whose grammar writes the message's header itself."""

    name: str
    grammar: Callable[[list[tuple[str, dict]], bool, Tags], str]
    parser: Callable[[Mapping[str, dict]], CallParser]
    markers: tuple[str, ...]
    channels: bool = False


FORMATS = {
    fmt.name: fmt
    for fmt in (
        ToolFormat("hermes", hermes.grammar, hermes.Parser, hermes.MARKERS),
        ToolFormat("llama3_json", llama3_json.grammar, llama3_json.Parser, llama3_json.MARKERS),
        ToolFormat("mistral", mistral.grammar, mistral.Parser, mistral.MARKERS),
        ToolFormat("qwen3_coder", qwen3_coder.grammar, qwen3_coder.Parser, qwen3_coder.MARKERS),
        ToolFormat("pythonic", pythonic.grammar, pythonic.Parser, pythonic.MARKERS),
        ToolFormat("openai", openai.grammar, openai.Parser, openai.MARKERS, channels=True),
    )
}
FORMATS["harmony"] = FORMATS["openai"]
# What a chat template writes, in the order asked, and the format it implies.
SIGNS = (
    (harmony.CHANNEL, "openai"),
    ("<function=", "qwen3_coder"),
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("func_name1(", "pythonic"),
    ("<|python_start|>", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": dictionary of argument name', "llama3_json"),
)


def choose(flag: str, template: str | None, renders_tools: bool) -> ToolFormat:
    """The format of --tool-call-parser `flag`; `auto`: the one the chat template writes (Hermes's for a
    template that renders no tools: the gateway then prompts for it). ValueError for a format other than
    Hermes's with a template that renders no tools (nothing would ask the model for it)."""
    if flag == "auto":
        found = next((name for sign, name in SIGNS if template and sign in template), "hermes")
        return FORMATS[found if renders_tools else "hermes"]
    if flag != "hermes" and not renders_tools:
        raise ValueError(
            f"--tool-call-parser {flag}: the model's chat template renders no tools, so the gateway prompts "
            "for Hermes's format; use --tool-call-parser hermes or auto"
        )
    return FORMATS[flag]
