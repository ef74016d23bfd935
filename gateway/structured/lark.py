"""Lark fragments of the gateway's own grammars (llguidance's dialect) that name the tokenizer's added
tokens. The grammar engine reads every added token (`<think>`, `<tool_call>`, `[TOOL_CALLS]`, ...) as a
special token, never as the bytes of its text: a grammar that writes such a tag as a string would make
the model spell it out of ordinary tokens. These fragments name the tag's token, as the model writes it."""

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tags:
    """The tokenizer's added tokens (text -> id) and, of those, the ones its decoding skips as special."""

    def __init__(self, added: Mapping[str, int], special: frozenset[int] = frozenset()) -> None:
        self.added = dict(added)
        self.special = special
        self._split = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
            if added
            else None
        )

    @classmethod
    def of(cls, tokenizer: "PreTrainedTokenizerBase") -> "Tags":
        added = tokenizer.get_added_vocab()
        return cls(added, frozenset(tokenizer.all_special_ids) & frozenset(added.values()))

    def literal(self, text: str) -> str:
        """A Lark expression matching exactly `text`, its added tokens as their tokens (`<[id]>`)."""
        if not text:
            return '""'
        parts = self._split.split(text) if self._split else [text]
        return " ".join(
            f"<[{self.added[part]}]>" if part in self.added else _string(part) for part in parts if part
        )

    def token(self, text: str) -> int | None:
        """The id of the added token whose text is `text`, if there is one."""
        return self.added.get(text)


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
