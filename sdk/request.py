"""The GenerateRequest the SDK's keyword arguments describe (sdk.client's `build_request`)."""

import json
from collections.abc import Mapping, Sequence

from protos import generation_pb2


def build_request(
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[dict] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
    request_id: str = "",
    n: int | None = None,
    cache_salt: str = "",
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    logprobs: int | None = None,
    min_tokens: int = 0,
    stop: str | Sequence[str] = (),
    priority: int = 0,
    json_schema: Mapping | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    tools: Sequence[Mapping] = (),
    tool_choice: str | None = None,
    parallel_tool_calls: bool | None = None,
    sparse_attention: bool | Mapping[str, int] | None = None,
    chat_template_kwargs: Mapping | None = None,
    prompt_logprobs: int | None = None,
    prompts: Sequence[str | Sequence[int]] = (),
    lora_adapter: str = "",
) -> generation_pb2.GenerateRequest:
    """priority: lower values are served first (and preempted last); equal priorities go by arrival. At most
    one constraint (json_schema, json_object, regex, choice, grammar). A chat message may carry `tool_calls`
    (ToolCall or dicts of id, name, arguments) or, with role "tool", `tool_call_id`. sparse_attention:
    block-sparse decode (True), dense (False), or its settings ({"sink": S, "recent": R, "topk": K}, any of
    them; the others the stack's); None: the stack's default (docs/sparse-attention.md). chat_template_kwargs:
    variables for the chat template of `messages` (`{"enable_thinking": False}`; docs/reasoning.md).
    prompt_logprobs: each prompt token's log-probability and that many alternatives, on sample 0's first
    chunk. prompts: several prompts (texts or token-id lists) in one request, instead of prompt or
    token_ids. lora_adapter: generate with that LoRA adapter (GetInfo lists them; docs/adapters.md)."""
    sampling = generation_pb2.SamplingParams(
        top_k=top_k,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias=logit_bias or {},
        min_tokens=min_tokens,
        stop=[stop] if isinstance(stop, str) else stop,
    )
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("seed", seed),
        ("n", n),
        ("min_p", min_p),
        ("repetition_penalty", repetition_penalty),
        ("logprobs", logprobs),
        ("prompt_logprobs", prompt_logprobs),
    ):
        if value is not None:
            setattr(sampling, name, value)
    request = generation_pb2.GenerateRequest(
        request_id=request_id,
        prompt=prompt or "",
        token_ids=token_ids or (),
        messages=[_message(m) for m in messages or ()],
        prompts=[
            generation_pb2.Prompt(text=p) if isinstance(p, str) else generation_pb2.Prompt(token_ids=p)
            for p in prompts
        ],
        sampling=sampling,
        cache_salt=cache_salt,
        priority=priority,
        lora_adapter=lora_adapter,
        tools=[
            generation_pb2.Tool(
                name=t["name"],
                description=t.get("description", ""),
                parameters=_json(t.get("parameters", "")),
            )
            for t in tools
        ],
    )
    _constrain(request.constraint, json_schema, json_object, regex, choice, grammar)
    if tool_choice in ("auto", "none", "required"):
        request.tool_choice.mode = tool_choice
    elif tool_choice is not None:
        request.tool_choice.function = tool_choice
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    if chat_template_kwargs is not None:
        request.chat_template_kwargs = json.dumps(dict(chat_template_kwargs))
    if sparse_attention is not None:
        settings = {} if isinstance(sparse_attention, bool) else dict(sparse_attention)
        request.sparse_attention.CopyFrom(
            generation_pb2.SparseAttention(enabled=sparse_attention is not False, **settings)
        )
    return request


def _json(value: Mapping | str) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _constrain(
    constraint: generation_pb2.Constraint, json_schema, json_object, regex, choice, grammar
) -> None:
    if json_schema is not None:
        constraint.json_schema = _json(json_schema)
    if json_object:
        constraint.json_object = True
    if regex is not None:
        constraint.regex = regex
    if choice is not None:
        constraint.choice.choices.extend(choice)
    if grammar is not None:
        constraint.grammar = grammar


def _message(m: Mapping) -> generation_pb2.ChatMessage:
    """A chat message; its content a string, or a list of parts {"type": "text", "text": str} and
    {"type": "image", "image": bytes} (the encoded image, docs/vision.md) in order."""
    calls = [c if isinstance(c, Mapping) else vars(c) for c in m.get("tool_calls", ())]
    content = m.get("content") or ""
    parts = [] if isinstance(content, str) else content
    return generation_pb2.ChatMessage(
        role=m["role"],
        content=content if isinstance(content, str) else "",
        parts=[
            generation_pb2.ImagePart(image=p["image"])
            if p["type"] == "image"
            else generation_pb2.ImagePart(text=p["text"])
            for p in parts
        ],
        tool_calls=[
            generation_pb2.ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"]) for c in calls
        ],
        tool_call_id=m.get("tool_call_id", ""),
    )


def tokenize_request(
    prompt: str | None = None,
    messages: Sequence[dict] | None = None,
    tools: Sequence[Mapping] = (),
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool | None = None,
    return_token_strs: bool = False,
) -> generation_pb2.TokenizeRequest:
    """The TokenizeRequest of a prompt or chat messages (with tools), as build_request writes them."""
    request = generation_pb2.TokenizeRequest(
        prompt=prompt or "",
        messages=[_message(m) for m in messages or ()],
        tools=build_request(tools=tools).tools,
        return_token_strs=return_token_strs,
    )
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    if add_generation_prompt is not None:
        request.add_generation_prompt = add_generation_prompt
    return request
