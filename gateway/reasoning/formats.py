"""The reasoning formats the gateway reads (--reasoning-parser, vLLM's names), and the one a chat template
implies (`auto`)."""

from dataclasses import dataclass

from gateway import harmony


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """A model family's reasoning tags: the reasoning is the text between `start` and `end` at the head of
    the answer. A template that writes `start` at the end of the prompt (DeepSeek-R1's, Qwen3-2507 Thinking's)
    leaves the answer starting inside the reasoning. `channels`: gpt-oss's harmony messages, the reasoning
    their `analysis` channel (`start` opens an analysis message, `end` ends a message)."""

    name: str
    start: str
    end: str
    channels: bool = False

    @property
    def markers(self) -> tuple[str, ...]:
        """The special tokens its splitter reads (kept in the text)."""
        return harmony.TOKENS if self.channels else (self.start, self.end)

    @property
    def signs(self) -> tuple[str, ...]:
        """What a chat template of the format writes."""
        return (harmony.CHANNEL,) if self.channels else (self.start, self.end)


HARMONY = ReasoningFormat("openai_gptoss", harmony.CHANNEL + "analysis" + harmony.MESSAGE, harmony.END, True)
FORMATS = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", "<think>", "</think>"),
    "mistral": ReasoningFormat("mistral", "[THINK]", "[/THINK]"),
    "openai_gptoss": HARMONY,
    "harmony": HARMONY,
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
        if template and any(sign in template for sign in fmt.signs):
            return fmt
    return None


def opened(fmt: ReasoningFormat, prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves the answer inside the reasoning (the template opened
    it: its last start tag is not closed)."""
    return prompt_tail.rfind(fmt.start) > prompt_tail.rfind(fmt.end)
