"""POST /v1/messages and /v1/messages/count_tokens: Messages bodies generated (or only tokenized) through the
same path as chat completions; the key may come as `x-api-key` (Anthropic's) or `Authorization: Bearer`;
errors in Anthropic's JSON, `{"type": "error", "error": {"type", "message"}}`."""

import asyncio
import json
from collections.abc import AsyncIterator

import structlog
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.errors import PagedServeError
from gateway.http.anthropic.output import MessageOutput, matched_stop
from gateway.http.anthropic.request import CountRequest, MessagesRequest, generate_request, has_images
from gateway.http.app import Installer
from gateway.http.body import request_json
from gateway.http.bridge import EventStream, unless_disconnected
from gateway.http.errors import HttpError, from_gateway
from gateway.http.guard import REQUEST_ID_HEADER, guarded
from gateway.http.openai_api import Front, gather
from gateway.http.openai_request import model_error, parse
from protos import generation_pb2

log = structlog.get_logger()
RENAMES = {"max_tokens": "max_tokens", "stop": "stop_sequences", "prompt": "messages"}
# OpenAI error types under Anthropic's names (the others are the same).
KINDS = {"service_unavailable_error": "overloaded_error", "server_error": "api_error",
         "conflict_error": "invalid_request_error"}  # fmt: skip
# The sample's last tokens a stop sequence is looked for in.
STOP_TAIL_TOKENS = 16


def messages_api(front: Front) -> Installer:
    """The installer of the Messages API's routes."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def create(request: Request) -> Response:
        return await guarded(
            request, lambda request_id: _message(front, request, request_id), RENAMES, refusal
        )

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await guarded(request, lambda request_id: _count(front, request, request_id), RENAMES, refusal)

    def install(app: FastAPI) -> None:
        app.include_router(router)

    return install


def refusal(err: HttpError) -> Response:
    kind = "request_too_large" if err.status == 413 else KINDS.get(err.kind, err.kind)
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": err.message}}, status_code=err.status
    )


def _tenant(front: Front, request: Request):
    """The caller: `x-api-key` counts as `Authorization: Bearer` (the anthropic SDK sends the former)."""
    headers = list(request.headers.items())
    key = request.headers.get("x-api-key")
    if key and "authorization" not in request.headers:
        headers.append(("authorization", f"Bearer {key}"))
    return front.generation.edge.authenticate(headers)


async def _parsed(front: Front, request: Request, kind):
    tenant = _tenant(front, request)
    body = parse(kind, request_json(request))
    info = front.generation.attached_model()
    name = front.generation.model_name(info)
    if body.model not in (name, *front.aliases):
        raise model_error(body.model, name)
    return tenant, body, info


async def _translated(front: Front, body, request_id: str) -> generation_pb2.GenerateRequest:
    if has_images(body.messages):
        # NOTE: image URLs are fetched and base64 decoded in a worker thread, not on the event loop.
        return await asyncio.to_thread(generate_request, body, request_id, front.media)
    return generate_request(body, request_id)


async def _count(front: Front, request: Request, request_id: str) -> Response:
    _, body, _ = await _parsed(front, request, CountRequest)
    proto = await _translated(front, body, request_id)
    tokens = await asyncio.to_thread(front.generation.count_prompt, proto)
    return JSONResponse({"input_tokens": tokens})


async def _message(front: Front, request: Request, request_id: str) -> Response:
    tenant, body, info = await _parsed(front, request, MessagesRequest)
    proto = await _translated(front, body, request_id)
    tokenizer, eos = front.generation.tokenizer, frozenset(info.eos_token_ids)
    tokens: list[int] = []

    def stop_sequence(reply: generation_pb2.GenerateResponse) -> str | None:
        if reply.finish_reason != generation_pb2.FINISH_REASON_STOP or not tokens or tokens[-1] in eos:
            return None
        return matched_stop(tokenizer.decode(tokens[-STOP_TAIL_TOKENS:]), body.stop_sequences or ())

    output = MessageOutput(front.generation.model_name(info), stop_sequence)
    replies = _counted(front.bridge.replies(proto, tenant), tokens)
    if body.stream:
        first = await unless_disconnected(request, anext(replies))
        return EventStream(_events(first, replies, output), {REQUEST_ID_HEADER: first.request_id})
    gathered = await unless_disconnected(request, gather(replies))
    for reply in gathered:
        output.events(reply)
    return JSONResponse(output.message(), headers={REQUEST_ID_HEADER: gathered[0].request_id})


async def _counted(
    replies: AsyncIterator, tokens: list[int]
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """The replies, their token ids noted in `tokens` as they pass."""
    try:
        async for reply in replies:
            tokens.extend(reply.token_ids)
            yield reply
    finally:
        await replies.aclose()


async def _events(first, replies: AsyncIterator, output: MessageOutput) -> AsyncIterator[str]:
    try:
        for event in [*output.start(), *output.events(first)]:
            yield _sse(event)
        async for reply in replies:
            for event in output.events(reply):
                yield _sse(event)
        for event in output.end():
            yield _sse(event)
    except PagedServeError as err:
        log.info("stream_failed", code=err.code.name, error=str(err))
        body = json.loads(refusal(from_gateway(err, RENAMES)).body)
        yield _sse(body)
    finally:
        await replies.aclose()


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
