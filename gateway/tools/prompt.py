"""Chat messages (with tool calls and tool results) and the request's tools as the chat template's inputs.
A template that renders tools gets them (transformers' apply_chat_template(tools=...)); one that does not
(SmolLM2's) gets the tool list in the system prompt and past calls and results in Hermes's format."""

from typing import TYPE_CHECKING

from gateway.tools import hermes
from gateway.tools.request import ToolUse, arguments
from protos import generation_pb2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def renders_tools(tokenizer: "PreTrainedTokenizerBase") -> bool:
    """Whether the chat template writes the `tools` it is given into the prompt."""
    parameters = {"type": "object", "properties": {}}
    probe = [{"type": "function", "function": {"name": "probe_function_7f3a", "parameters": parameters}}]
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=probe, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        return False
    return "probe_function_7f3a" in text


def conversation(messages, tools: ToolUse | None, native: bool) -> tuple[list[dict], list[dict] | None]:
    """The template's messages and tools; `native`: the template renders tools and calls itself."""
    out = [_message(m, native) for m in messages]
    if tools is None or native:
        return out, list(tools.tools) if tools else None
    listed = hermes.tools_prompt(list(tools.tools))
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{listed}"
    else:
        out.insert(0, {"role": "system", "content": listed})
    return out, None


def _message(message: generation_pb2.ChatMessage, native: bool) -> dict:
    entry = {"role": message.role, "content": _content(message)}
    if native:
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": arguments(c.arguments)},
                }
                for c in message.tool_calls
            ]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.name:
            entry["name"] = message.name
        return entry
    calls = [hermes.call_text(c.name, arguments(c.arguments)) for c in message.tool_calls]
    if calls:
        entry["content"] = "\n".join([message.content, *calls] if message.content else calls)
    if message.role == "tool":
        entry["content"] = hermes.response_text(message.content)
    return entry


def _content(message: generation_pb2.ChatMessage) -> str | list[dict]:
    """The content, or the message's parts: their text joined, or with images the template's part list."""
    parts = message.parts
    if not parts:
        return message.content
    if all(part.WhichOneof("part") == "text" for part in parts):
        return "".join(part.text for part in parts)
    return [
        {"type": "text", "text": p.text} if p.WhichOneof("part") == "text" else {"type": "image"}
        for p in parts
    ]
