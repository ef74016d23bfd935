"""Messages API bodies, checked and turned into a chat GenerateRequest: `system` as the system message, text,
`tool_use` and `tool_result` blocks as chat messages with tool calls and tool results, a user turn's `image`
blocks as image parts among its text (as OpenAI `image_url` parts are: gateway.http.image_parts), `tools` and
`tool_choice` as the gateway's, `thinking` as the template's `enable_thinking`."""

import json
from typing import Annotated, Literal

from pydantic import Field

from gateway.http.errors import invalid
from gateway.http.image_parts import DATA_ONLY, MediaSources, base64_bytes
from gateway.http.openai_request import Int32, _Body
from protos import generation_pb2


class CacheControl(_Body):
    """Accepted and ignored: the prefix cache reuses every prompt's cached blocks by itself."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Body):
    """Earlier reasoning fed back: accepted, not rendered (chat templates drop past reasoning)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class Base64Source(_Body):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(_Body):
    """An image URL, read as an OpenAI image_url part's is (--allowed-media-domains)."""

    type: Literal["url"]
    url: str


class ImageBlock(_Body):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: Int32 | None = None


class Metadata(_Body):
    user_id: str | None = None


class MessagesRequest(_Body):
    model: str
    max_tokens: Int32
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # accepted and ignored: labels the caller
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


class CountRequest(_Body):
    """POST /v1/messages/count_tokens: the prompt of a Messages body, nothing generated."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


def generate_request(
    body: MessagesRequest | CountRequest, request_id: str, media: MediaSources = DATA_ONLY
) -> generation_pb2.GenerateRequest:
    """The GenerateRequest of a Messages body (of a count_tokens body: its prompt); image URLs read as
    `media` allows."""
    request = generation_pb2.GenerateRequest(request_id=request_id)
    if isinstance(body, MessagesRequest):
        if body.max_tokens < 1:
            raise invalid("max_tokens must be at least 1", "max_tokens")
        sampling = request.sampling
        sampling.max_tokens = body.max_tokens
        for name in ("temperature", "top_p"):
            if getattr(body, name) is not None:
                setattr(sampling, name, getattr(body, name))
        sampling.top_k = body.top_k or 0
        sampling.stop.extend(body.stop_sequences or ())
    if body.system:
        request.messages.add(role="system", content=_text(body.system))
    request.messages.extend(chat_messages(body.messages, media))
    for tool in body.tools or ():
        schema = json.dumps(tool.input_schema, ensure_ascii=False)
        request.tools.add(name=tool.name, description=tool.description or "", parameters=schema)
    _set_choice(body.tool_choice, request)
    if body.thinking is not None:
        kwargs = {"enable_thinking": body.thinking.type == "enabled"}
        request.chat_template_kwargs = json.dumps(kwargs)
    return request


def has_images(messages: list[Message]) -> bool:
    return any(
        isinstance(block, ImageBlock) for m in messages if isinstance(m.content, list) for block in m.content
    )


def chat_messages(
    messages: list[Message], media: MediaSources = DATA_ONLY
) -> list[generation_pb2.ChatMessage]:
    """The chat messages of Messages turns: a user turn's tool_result blocks are tool messages (before its
    text and images), an assistant turn's tool_use blocks its tool calls."""
    out = []
    for i, message in enumerate(messages):
        blocks = (
            [TextBlock(type="text", text=message.content)]
            if isinstance(message.content, str)
            else message.content
        )
        text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
        images = [j for j, block in enumerate(blocks) if isinstance(block, ImageBlock)]
        if message.role == "assistant":
            if images:
                where = f"messages[{i}].content[{images[0]}]"
                raise invalid(f"{where}: image blocks go in user turns, not the assistant's", where)
            turn = generation_pb2.ChatMessage(role="assistant", content=text)
            for block in blocks:
                if isinstance(block, ToolUseBlock):
                    turn.tool_calls.add(id=block.id, name=block.name, arguments=json.dumps(block.input))
            out.append(turn)
            continue
        for block in blocks:
            if isinstance(block, ToolUseBlock):
                raise invalid(
                    f"messages[{i}]: a user turn holds no tool_use block (only the assistant's)", "messages"
                )
            if isinstance(block, ToolResultBlock):
                result = generation_pb2.ChatMessage(
                    role="tool", content=_text(block.content), tool_call_id=block.tool_use_id
                )
                out.append(result)
        if images:
            parts = [_part(block, f"messages[{i}].content[{j}]", media) for j, block in enumerate(blocks)]
            out.append(generation_pb2.ChatMessage(role="user", parts=[p for p in parts if p is not None]))
        elif text or not any(isinstance(block, ToolResultBlock) for block in blocks):
            out.append(generation_pb2.ChatMessage(role="user", content=text))
    return out


def _part(block, where: str, media: MediaSources) -> generation_pb2.ImagePart | None:
    """A user turn's text or image block as a part, in order; None for a block that is no part."""
    if isinstance(block, TextBlock):
        return generation_pb2.ImagePart(text=block.text)
    if not isinstance(block, ImageBlock):
        return None
    source = block.source
    if isinstance(source, URLSource):
        return generation_pb2.ImagePart(image=media.image_bytes(source.url, f"{where}.source.url"))
    return generation_pb2.ImagePart(image=base64_bytes(source.data, f"{where}.source.data"))


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _set_choice(choice: ToolChoice | None, request: generation_pb2.GenerateRequest) -> None:
    if choice is None:
        return
    if choice.type == "tool":
        if not choice.name:
            raise invalid("tool_choice of type tool needs the tool's name", "tool_choice")
        request.tool_choice.function = choice.name
    else:
        request.tool_choice.mode = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use is not None:
        request.parallel_tool_calls = not choice.disable_parallel_tool_use
