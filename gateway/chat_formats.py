"""The formats a served model's chat answers are read in: its tool calls' (--tool-call-parser) and its
reasoning's (--reasoning-parser), each given or found in the chat template, and the tokenizer's tags."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway import tokenizer as tok
from gateway.reasoning import formats as reasoning_formats
from gateway.reasoning.formats import ReasoningFormat
from gateway.structured.lark import Tags
from gateway.tools import formats as tool_formats
from gateway.tools.formats import ToolFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class ChatFormats:
    tools: ToolFormat
    # None: the answer is not split (no reasoning parser, or a template without reasoning tags).
    reasoning: ReasoningFormat | None
    tags: Tags

    @classmethod
    def of(cls, tokenizer: "PreTrainedTokenizerBase", tool_flag: str, reasoning_flag: str) -> "ChatFormats":
        """The formats of the flags for this tokenizer; ValueError (one line saying what is supported) for a
        tool-call format its chat template cannot be prompted for."""
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        renders = template is not None and tok.renders_tools(tokenizer)
        return cls(
            tool_formats.choose(tool_flag, template, renders),
            reasoning_formats.choose(reasoning_flag, template),
            Tags.of(tokenizer),
        )

    def keep(self, tools: bool, reasoning: bool) -> frozenset[int]:
        """The special tokens a request's text keeps for its parsers (its tools', its reasoning's tags)."""
        texts = (*(self.tools.markers if tools else ()), *(self.reasoning.markers if reasoning else ()))
        ids = {self.tags.token(text) for text in texts}
        return frozenset(ids & self.tags.special)
