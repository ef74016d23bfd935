"""vLLM's tokenizer routes (an installer of the HTTP app): POST /tokenize (a prompt, or chat messages rendered
as the chat completions render them), POST /detokenize, GET /tokenizer_info; the same API keys and limits
as the generation routes, refusals in OpenAI's error JSON."""

import json
from collections.abc import Callable, Mapping

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from common.errors import PagedServeError
from gateway.http import lora_api
from gateway.http.app import Installer
from gateway.http.body import request_json
from gateway.http.errors import HttpError, from_gateway
from gateway.http.openai_api import Front
from gateway.http.openai_request import Int32, Message, chat_messages, parse
from gateway.http.openai_structured import ToolDef, function_tools
from protos import generation_pb2


class _Body(BaseModel):
    # NOTE: strict, unknown fields refused, as the generation bodies (gateway.http.openai_request).
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizePrompt(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Body):
    model: str | None = None
    messages: list[Message]
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = None


class Detokenize(_Body):
    model: str | None = None
    tokens: list[Int32]


# The tokenizer's settings /tokenizer_info shows (vLLM's names), when the tokenizer has them.
_INFO = ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template", "model_max_length")


def tokenize_api(front: Front) -> Installer:
    """The installer of the tokenizer routes."""

    def install(app: FastAPI) -> None:
        app.include_router(_router(front))

    return install


def _router(front: Front) -> APIRouter:
    router = APIRouter()
    generation = front.generation

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        def answer() -> dict:
            body = _body(front, request, TokenizeChat if "messages" in _object(request) else TokenizePrompt)
            reply = generation.tokenize(_tokenize_request(body))
            ids, strs = list(reply.token_ids), list(reply.token_strs) if body.return_token_strs else None
            size = reply.max_model_len
            return {"count": len(ids), "max_model_len": size, "tokens": ids, "token_strs": strs}

        return _refusing(answer)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        def answer() -> dict:
            body = _body(front, request, Detokenize)
            reply = generation.detokenize(generation_pb2.DetokenizeRequest(token_ids=body.tokens))
            return {"prompt": reply.text}

        return _refusing(answer, {"token_ids": "tokens"})

    @router.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        def answer() -> dict:
            generation.edge.authenticate(request.headers.items())
            tokenizer = generation.tokenizer
            info = {"tokenizer_class": type(tokenizer).__name__}
            info.update({k: getattr(tokenizer, k) for k in _INFO if getattr(tokenizer, k, None) is not None})
            return info

        return _refusing(answer)

    return router


def _object(request: Request) -> dict:
    body = request_json(request)
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object", "invalid_request_error")
    return body


def _body(front: Front, request: Request, kind: type[_Body]) -> _Body:
    """The request's body as `kind`, after its API key; 404 for a model that is neither the base model nor
    one of its LoRA adapters (which tokenize as the base model does)."""
    front.generation.edge.authenticate(request.headers.items())
    body = parse(kind, _object(request))
    lora_api.adapter_of(front, body.model, front.generation.model_name(front.generation.attached_model()))
    return body


def _tokenize_request(body: TokenizePrompt | TokenizeChat) -> generation_pb2.TokenizeRequest:
    request = generation_pb2.TokenizeRequest(
        add_special_tokens=body.add_special_tokens, return_token_strs=body.return_token_strs
    )
    if isinstance(body, TokenizePrompt):
        request.prompt = body.prompt
        return request
    request.messages.extend(chat_messages(body.messages))
    request.tools.extend(function_tools(body.tools))
    request.add_generation_prompt = body.add_generation_prompt
    if body.chat_template_kwargs is not None:
        request.chat_template_kwargs = json.dumps(body.chat_template_kwargs, ensure_ascii=False)
    return request


def _refusing(answer: Callable[[], dict], renames: Mapping[str, str] = {}) -> Response:
    """The answer, or its refusal in OpenAI's error JSON (`renames`: gateway field -> this route's name)."""
    try:
        return JSONResponse(answer())
    except HttpError as err:
        return err.response()
    except PagedServeError as err:
        return from_gateway(err, renames).response()
