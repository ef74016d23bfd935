"""OpenAI request bodies (completions and chat completions), checked and translated into the gateway's
GenerateRequest; the gateway then checks the values as it checks any gRPC request.

Every parameter the bodies declare is honoured. `user` is accepted and ignored (it only labels the caller
at OpenAI). Any other field is refused (400, naming it) rather than silently ignored, and so are values
of declared fields pagedserve cannot serve (`suffix`, `best_of` other than `n`, chat content parts other
than text and images, image URLs other than `data:` unless the operator allows them).
"""

import json
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.http.errors import HttpError, invalid
from gateway.http.image_parts import DATA_ONLY, ImagePart, MediaSources, image_part
from gateway.http.openai_structured import (
    Constrained,
    MessageToolCall,
    NamedToolChoice,
    ToolDef,
    set_constraint,
    set_tools,
)
from protos import generation_pb2

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Uint64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
# Sampling fields whose OpenAI/vLLM name and meaning are the gateway's own.
SAME = (
    "temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "prompt_logprobs",
)  # fmt: skip


class _Body(BaseModel):
    # NOTE: strict: "1" is no number and 1.0 no integer, as OpenAI's API has it; unknown fields refused.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class ResumedSample(_Body):
    """pagedserve's: what a client received of one choice before its stream broke (GenerateRequest.resume)."""

    index: Int32
    token_ids: list[Int32] = []
    finished: bool = False


class SparseAttention(_Body):
    """pagedserve's: block-sparse decode (GenerateRequest.sparse_attention); unset settings: the stack's."""

    enabled: bool = True
    sink: Int32 | None = None
    recent: Int32 | None = None
    topk: Int32 | None = None


class _Request(Constrained):
    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int32 | None = None
    stop: str | list[str] | None = None
    seed: Uint64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int32] | None = None
    cache_salt: str | None = None
    priority: Int32 | None = None
    prompt_logprobs: Int32 | None = None
    # pagedserve's: each choice's token ids in its chunks, and resuming a broken stream (docs/api.md)
    return_token_ids: bool = False
    resume: list[ResumedSample] | None = None
    # pagedserve's: block-sparse decode, true / false or its settings (docs/sparse-attention.md)
    sparse_attention: bool | SparseAttention | None = None


Body = TypeVar("Body", bound=_Request)


# A completions prompt: text, token ids, or a list of either (several prompts).
PromptField = str | list[str] | list[Int32] | list[list[Int32]]
PROMPT_SHAPES = (
    "prompt must be a string, a list of token ids (integers), or a list of strings or of token-id lists "
    "(several prompts)"
)


class CompletionRequest(_Request):
    prompt: PromptField
    logprobs: Int32 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int32 | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str
    # None (or absent) in an assistant message that only called tools
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: variables for the chat template (`{"enable_thinking": false}`)
    chat_template_kwargs: dict | None = None


def parse(kind: type["Body"], body: object) -> "Body":
    """The body as a `kind`; 400 naming the first field that is unknown, of the wrong type or out of its
    range (for a field of several types, what each of them expected)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return kind.model_validate(body)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
        if errors[0]["type"] == "extra_forbidden":
            where = _where(errors[0]["loc"])
            raise invalid(
                f"unsupported parameter {where!r}: pagedserve does not implement it", param
            ) from None
        if param == "prompt" and kind is CompletionRequest:
            raise invalid(PROMPT_SHAPES, param) from None
        same = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
        what = dict.fromkeys(f"{_where(e['loc'])}: {e['msg']}" for e in same)
        raise invalid("; or ".join(list(what)[:3]), param) from None


# Tags pydantic adds to an error's location inside a field of several types.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def _where(loc: tuple) -> str:
    """An error's location as a JSON path: `messages[0].content`."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path


def completion_request(body: CompletionRequest, request_id: str) -> generation_pb2.GenerateRequest:
    """The GenerateRequest of a completions body (several prompts: GenerateRequest.prompts); 400 for what
    pagedserve does not serve. With echo and logprobs the prompt's tokens are scored too (prompt_logprobs at
    least as wide as logprobs)."""
    if body.suffix:
        raise invalid("suffix is not supported (no insertion mode)", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise invalid("best_of is not supported: ask for n samples instead", "best_of")
    prompts = completion_prompts(body.prompt)
    request = _request(body, request_id, body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None:
        request.sampling.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
    if len(prompts) > 1:
        request.prompts.extend(
            generation_pb2.Prompt(text=p) if isinstance(p, str) else generation_pb2.Prompt(token_ids=p)
            for p in prompts
        )
    elif isinstance(prompts[0], str):
        request.prompt = prompts[0]
    else:
        request.token_ids.extend(prompts[0])
    return request


def completion_prompts(prompt: PromptField) -> list[str | list[int]]:
    """The body's prompts, one per choice group (a token-id list is one prompt); 400 for an empty one."""
    one = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
    prompts = [prompt] if one else list(prompt)
    if not prompts:
        raise invalid("prompt is an empty list: give a string, token ids, or a list of either", "prompt")
    for i, one in enumerate(prompts):
        if not one:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise invalid(f"{where} is empty: give some text or token ids", "prompt")
    return prompts


def chat_request(
    body: ChatRequest, request_id: str, max_model_len: int, media: MediaSources = DATA_ONLY
) -> generation_pb2.GenerateRequest:
    """The GenerateRequest of a chat body (its image URLs read as `media` allows). Without
    max_tokens/max_completion_tokens a chat goes on until the model ends it or its context is full
    (OpenAI's default)."""
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("give max_completion_tokens or max_tokens, not both", "max_tokens")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    if body.max_completion_tokens is None and body.max_tokens is None:
        max_tokens = max_model_len
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request = _request(body, request_id, max_tokens, logprobs)
    request.messages.extend(chat_messages(body.messages, media))
    set_tools(body.tools, body.tool_choice, body.parallel_tool_calls, request)
    if body.chat_template_kwargs is not None:
        request.chat_template_kwargs = json.dumps(body.chat_template_kwargs, ensure_ascii=False)
    return request


def chat_messages(
    messages: list[Message], media: MediaSources = DATA_ONLY
) -> list[generation_pb2.ChatMessage]:
    """The chat messages as the gateway takes them (text parts joined)."""
    converted = []
    for i, message in enumerate(messages):
        content = message.content or ""
        parts = [] if isinstance(content, str) else content
        with_images = any(isinstance(part, ImagePart) for part in parts)
        text = content if isinstance(content, str) else "".join(getattr(part, "text", "") for part in content)
        converted.append(
            generation_pb2.ChatMessage(
                role=message.role,
                content="" if with_images else text,
                parts=[
                    image_part(part, f"messages[{i}].content[{j}]", media)
                    if isinstance(part, ImagePart)
                    else generation_pb2.ImagePart(text=part.text)
                    for j, part in enumerate(parts)
                ]
                if with_images
                else [],
                tool_call_id=message.tool_call_id or "",
                name=message.name or "",
                tool_calls=[
                    generation_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                    for c in message.tool_calls or ()
                ],
            )
        )
    return converted


def _request(
    body: _Request, request_id: str, max_tokens: int | None, logprobs: int | None
) -> generation_pb2.GenerateRequest:
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    sampling = generation_pb2.SamplingParams(
        **{name: getattr(body, name) for name in SAME if getattr(body, name) is not None}
    )
    if body.top_k == -1:
        sampling.top_k = 0  # vLLM's "off"
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if logprobs is not None:
        sampling.logprobs = logprobs
    if body.stop is not None:
        sampling.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    for token, bias in (body.logit_bias or {}).items():
        sampling.logit_bias[_token_id(token)] = bias
    request = generation_pb2.GenerateRequest(
        request_id=request_id,
        sampling=sampling,
        cache_salt=body.cache_salt or "",
        priority=body.priority or 0,
        resume=[generation_pb2.ResumedSample(**sample.model_dump()) for sample in body.resume or ()],
    )
    set_constraint(body, request)
    sparse = body.sparse_attention
    if sparse is not None:
        sparse = SparseAttention(enabled=sparse) if isinstance(sparse, bool) else sparse
        request.sparse_attention.CopyFrom(
            generation_pb2.SparseAttention(**sparse.model_dump(exclude_none=True))
        )
    return request


def _token_id(key: str) -> int:
    """A logit_bias key: a token id written as a JSON string."""
    try:
        token = int(key)
    except ValueError:
        token = None
    if token is None or not -(2**31) <= token < 2**31:
        raise invalid(f"logit_bias keys are token ids, got {key[:40]!r}", "logit_bias")
    return token


def model_error(model: str, served: str) -> HttpError:
    return HttpError(
        404,
        f"the model {model[:200]!r} does not exist: this server serves {served!r} (GET /v1/models)",
        "not_found_error",
        "model",
        "model_not_found",
    )
