"""The reasoning formats the gateway reads (--reasoning-parser, vLLM's names), and the one a chat template
implies (`auto`)."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """A model family's reasoning tags: the reasoning is the text between `start` and `end` at the head of
    the answer. A template that writes `start` at the end of the prompt (DeepSeek-R1's, Qwen3-2507 Thinking's)
    leaves the answer starting inside the reasoning."""

    name: str
    start: str
    end: str


FORMATS = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", "<think>", "</think>"),
    "mistral": ReasoningFormat("mistral", "[THINK]", "[/THINK]"),
}
NAMES = ("auto", "none", *FORMATS)


def choose(flag: str, template: str | None) -> ReasoningFormat | None:
    """The format of --reasoning-parser `flag`: `none` reads no reasoning; `auto` the format whose tags the
    chat template writes (None for a template that writes none, or no template)."""
    if flag == "none":
        return None
    if flag != "auto":
        return FORMATS[flag]
    for fmt in FORMATS.values():
        if template and (fmt.start in template or fmt.end in template):
            return fmt
    return None


def opened(fmt: ReasoningFormat, prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves the answer inside the reasoning (the template opened
    it: its last start tag is not closed)."""
    return prompt_tail.rfind(fmt.start) > prompt_tail.rfind(fmt.end)
