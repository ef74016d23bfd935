"""Tokenize and Detokenize (gRPC, and vLLM's /tokenize and /detokenize over HTTP): a prompt's or chat's token
ids exactly as Generate encodes them, under the same limits, and the text of token ids."""

from common.errors import InvalidArgument
from gateway import tokenizer as tok
from gateway.limits import EdgeLimits, check_request
from gateway.structured.limits import ConstraintLimits
from gateway.tools import request as tool_request
from protos import generation_pb2


def tokenize(
    tokenizer,
    request: generation_pb2.TokenizeRequest,
    info,
    limits: EdgeLimits,
    constraint_limits: ConstraintLimits,
) -> generation_pb2.TokenizeResponse:
    """The request's token ids (and pieces, if asked); INVALID_ARGUMENT naming the field for a request that is
    not exactly one of prompt and messages, or beyond a limit."""
    if bool(request.prompt) == bool(request.messages):
        raise InvalidArgument("set exactly one of prompt and messages")
    if request.tools and not request.messages:
        raise InvalidArgument("tools are rendered with messages only")
    if request.HasField("add_generation_prompt") and not request.messages:
        raise InvalidArgument("add_generation_prompt applies to messages only")
    as_generated = generation_pb2.GenerateRequest(
        prompt=request.prompt,
        messages=request.messages,
        tools=request.tools,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    check_request(as_generated, limits, info.max_model_len)
    tools = tool_request.from_request(
        as_generated,
        constraint_limits.max_tools,
        constraint_limits.max_constraint_bytes,
        constraint_limits.max_constraint_depth,
    )
    ids = tok.encode(
        tokenizer,
        as_generated,
        info.vocab_size,
        tools,
        add_special_tokens=request.add_special_tokens if request.HasField("add_special_tokens") else None,
        add_generation_prompt=request.add_generation_prompt
        if request.HasField("add_generation_prompt")
        else True,
    )
    reply = generation_pb2.TokenizeResponse(token_ids=ids, max_model_len=info.max_model_len)
    if request.return_token_strs:
        reply.token_strs.extend(tokenizer.convert_ids_to_tokens(ids))
    return reply


def detokenize(
    tokenizer, request: generation_pb2.DetokenizeRequest, vocab_size: int, max_tokens: int
) -> generation_pb2.DetokenizeResponse:
    """The text of the token ids (special tokens included); INVALID_ARGUMENT for an id outside the vocabulary
    or more ids than the model's length."""
    if len(request.token_ids) > max_tokens:
        raise InvalidArgument(
            f"token_ids has {len(request.token_ids)} entries; the model's length is {max_tokens} tokens"
        )
    tok.check_vocabulary(list(request.token_ids), vocab_size, "token_ids: ")
    return generation_pb2.DetokenizeResponse(text=tokenizer.decode(list(request.token_ids)))
