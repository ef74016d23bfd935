"""Prompt encoding (text, token ids or chat messages, with tools) and incremental detokenization."""

import contextlib
import functools
import importlib
import json
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from common.errors import InvalidArgument
from gateway.tools import prompt
from gateway.tools.request import ToolUse
from protos import generation_pb2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The chat roles of OpenAI's API; any other is refused, never rendered as the template sees fit.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template's own arguments, which chat_template_kwargs may not set.
RESERVED_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "add_generation_prompt",
     "continue_final_message", "return_dict", "return_tensors", "padding", "truncation", "max_length",
     "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip


# transformers' environment variable that silences its advice, here that models need torch.
NO_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def load(path: str) -> "PreTrainedTokenizerBase":
    """transformers' AutoTokenizer for the model directory at `path`.

    NOTE: in a process that has imported neither torch nor transformers yet (the gateway's), transformers is
    imported with torch hidden from it: it decides once, on import, whether torch is there, and with torch
    there any model config it reads (AutoTokenizer reads one) imports torch, a second and a half of CPU at
    every start. Its tokenizers and chat templates need no torch, and render the same without."""
    if "torch" not in sys.modules and "transformers" not in sys.modules:
        with _torch_hidden():
            importlib.import_module("transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """torch reported missing (importlib.util.find_spec gives None) inside the block, transformers' advice
    about it silenced; both as before after it."""
    advice = os.environ.get(NO_ADVICE)
    sys.modules["torch"] = None
    os.environ[NO_ADVICE] = "1"
    try:
        yield
    finally:
        del sys.modules["torch"]
        if advice is None:
            del os.environ[NO_ADVICE]
        else:
            os.environ[NO_ADVICE] = advice


def encode(
    tokenizer: "PreTrainedTokenizerBase",
    request: generation_pb2.GenerateRequest,
    vocab_size: int,
    tools: ToolUse | None = None,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The prompt's token ids (chat messages rendered with `tools`); InvalidArgument unless exactly one of
    prompt, token_ids, messages is given. The tokenizer's special tokens (BOS) are added to a prompt, not to
    rendered messages (their template writes its own), unless `add_special_tokens` says otherwise; messages
    end with the assistant's generation prompt unless `add_generation_prompt` is false."""
    given = [
        name
        for name, present in (
            ("prompt", bool(request.prompt)),
            ("token_ids", bool(request.token_ids)),
            ("messages", bool(request.messages)),
        )
        if present
    ]
    if not given:
        raise InvalidArgument("empty prompt: set one of prompt, token_ids or messages")
    if len(given) > 1:
        raise InvalidArgument(f"set exactly one of prompt, token_ids or messages, got {' and '.join(given)}")
    if any(part.WhichOneof("part") == "image" for m in request.messages for part in m.parts):
        raise InvalidArgument("image parts are taken by Generate and chat completions only (docs/vision.md)")
    if request.chat_template_kwargs and not request.messages:
        raise InvalidArgument("chat_template_kwargs needs chat messages: send messages, not prompt")
    if request.token_ids:
        ids = list(request.token_ids)
    elif request.messages:
        kwargs = template_kwargs(request.chat_template_kwargs)
        special = bool(add_special_tokens)
        ids = _render_chat(tokenizer, request.messages, tools, kwargs, special, add_generation_prompt)
    else:
        ids = tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens is not False)
    # NOTE: checked for text too: a tokenizer may know more tokens than the model (compute refuses those).
    check_vocabulary(ids, vocab_size)
    return ids


def check_vocabulary(ids: list[int], vocab_size: int, where: str = "") -> None:
    """InvalidArgument (its message starting with `where`) for the first id outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{where}token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def template_kwargs(text: str) -> dict:
    """chat_template_kwargs parsed: a JSON object whose keys are not apply_chat_template's own arguments."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except ValueError as err:
        raise InvalidArgument(f"chat_template_kwargs is not valid JSON: {err}") from None
    if not isinstance(kwargs, dict):
        raise InvalidArgument(f"chat_template_kwargs must be a JSON object, got {type(kwargs).__name__}")
    reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidArgument(
            f"chat_template_kwargs.{reserved[0]} is set by the request itself, not by template variables"
        )
    return kwargs


def _render_chat(
    tokenizer: "PreTrainedTokenizerBase",
    messages,
    tools: ToolUse | None,
    kwargs: dict,
    add_special_tokens: bool = False,
    add_generation_prompt: bool = True,
) -> list[int]:
    if tokenizer.chat_template is None:
        raise InvalidArgument("this model has no chat template: send prompt or token_ids instead of messages")
    conversation, listed = chat_conversation(tokenizer, messages, tools)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=listed, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's to fix
        raise InvalidArgument(f"cannot render messages with the chat template: {exc}") from exc
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_conversation(
    tokenizer: "PreTrainedTokenizerBase", messages, tools: ToolUse | None
) -> tuple[list[dict], list[dict] | None]:
    """The chat template's messages and tools (gateway.tools.prompt); InvalidArgument for a role not one of
    CHAT_ROLES."""
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            given = f"role {message.role!r}" if message.role else "no role"
            raise InvalidArgument(f"messages[{i}] has {given}: use one of {', '.join(CHAT_ROLES)}")
    return prompt.conversation(messages, tools, renders_tools(tokenizer))


@functools.lru_cache(maxsize=4)
def renders_tools(tokenizer: "PreTrainedTokenizerBase") -> bool:
    """Whether the tokenizer's chat template renders tools (asked once per tokenizer)."""
    return prompt.renders_tools(tokenizer)


class Detokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation equals decoding them all.

    NOTE: text is only released once it no longer ends in U+FFFD, so a multi-byte character split
    across tokens comes out whole, and the surrounding window keeps spaces that depend on neighbours.
    """

    __slots__ = ("_tokenizer", "_skipped", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", keep: frozenset[int] = frozenset()) -> None:
        """`keep`: special tokens whose text stays in (a tool-call or reasoning format's tags)."""
        self._tokenizer = tokenizer
        self._skipped = frozenset(tokenizer.all_special_ids) - keep if keep else None
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if self._skipped is None:
            return self._tokenizer.decode(ids, skip_special_tokens=True)
        return self._tokenizer.decode([t for t in ids if t not in self._skipped], skip_special_tokens=False)

    def step(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """What is still held back at the end of the generation."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]
