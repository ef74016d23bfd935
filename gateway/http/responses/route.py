"""POST /v1/responses: a Responses body generated through the same path as chat completions (keys, limits,
stream slots, admission, engine), answered whole or as the SDK's event stream; unless `store` is false the
response is kept, for `previous_response_id` and for GET /v1/responses/{id} (and its input_items) and
DELETE, each under the API key that made it."""

import json
from collections.abc import AsyncIterator

import structlog
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.errors import PagedServeError
from gateway.http import lora_api
from gateway.http.app import Installer
from gateway.http.body import request_json
from gateway.http.bridge import EventStream, unless_disconnected
from gateway.http.errors import from_gateway, invalid
from gateway.http.guard import REQUEST_ID_HEADER, guarded
from gateway.http.openai_api import Front, gather
from gateway.http.openai_request import parse
from gateway.http.responses.output import ResponseOutput
from gateway.http.responses.request import (
    ResponsesRequest,
    generate_request,
    input_items,
    input_messages,
    not_found,
    not_stored,
)
from gateway.http.responses.store import Stored
from protos import generation_pb2

log = structlog.get_logger()
# Gateway fields under their Responses names.
RENAMES = {"max_tokens": "max_output_tokens", "messages": "input", "constraint": "text", "prompt": "input"}


def responses_api(front: Front) -> Installer:
    """The installer of POST /v1/responses."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        return await guarded(request, lambda request_id: _respond(front, request, request_id), RENAMES)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        return await guarded(request, lambda _: _retrieve(front, request, response_id))

    @router.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        return await guarded(request, lambda _: _delete(front, request, response_id))

    @router.get("/v1/responses/{response_id}/input_items")
    async def items(request: Request, response_id: str) -> Response:
        return await guarded(request, lambda _: _input_items(front, request, response_id))

    def install(app: FastAPI) -> None:
        app.include_router(router)

    return install


async def _respond(front: Front, request: Request, request_id: str) -> Response:
    tenant = front.generation.edge.authenticate(request.headers.items())
    body = parse(ResponsesRequest, request_json(request))
    info = front.generation.attached_model()
    name = front.generation.model_name(info)
    adapter = lora_api.adapter_of(front, body.model, name)
    history: tuple[generation_pb2.ChatMessage, ...] = ()
    if body.previous_response_id is not None:
        previous = front.responses.get(tenant.name, body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id)
        history = previous.conversation
    proto = generate_request(body, request_id, info.max_model_len, history)
    proto.lora_adapter = adapter
    output = ResponseOutput(body, adapter or name, body.previous_response_id)
    conversation = [*history, *input_messages(body)]
    items = input_items(body)

    def keep() -> None:
        if body.store:
            front.responses.put(tenant.name, output.response(), items, [*conversation, _assistant(output)])

    replies = front.bridge.replies(proto, tenant)
    if body.stream:
        first = await unless_disconnected(request, anext(replies))
        return EventStream(_events(first, replies, output, keep), {REQUEST_ID_HEADER: first.request_id})
    gathered = await unless_disconnected(request, gather(replies))
    for reply in gathered:
        output.events(reply)
    keep()
    return JSONResponse(output.response(), headers={REQUEST_ID_HEADER: gathered[0].request_id})


async def _retrieve(front: Front, request: Request, response_id: str) -> Response:
    if request.query_params.get("stream", "false") != "false":
        raise invalid("a stored response is retrieved whole: stream replays background responses", "stream")
    return JSONResponse(_stored(front, request, response_id).response)


async def _delete(front: Front, request: Request, response_id: str) -> Response:
    tenant = front.generation.edge.authenticate(request.headers.items())
    if not front.responses.delete(tenant.name, response_id):
        raise not_stored(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _input_items(front: Front, request: Request, response_id: str) -> Response:
    """A page of the response's input items, as the API's cursor list: `order` (desc, the default, or asc),
    `limit` (1-100, default 20), `after` (the last id of the page before)."""
    query = request.query_params
    order, after = query.get("order", "desc"), query.get("after")
    if order not in ("asc", "desc"):
        raise invalid(f"order must be asc or desc, not {order[:20]!r}", "order")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise invalid(f"limit must be a whole number from 1 to 100, not {limit[:20]!r}", "limit")
    items = list(_stored(front, request, response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid(f"after {after[:80]!r} is not one of the response's input item ids", "after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


def _stored(front: Front, request: Request, response_id: str) -> Stored:
    tenant = front.generation.edge.authenticate(request.headers.items())
    kept = front.responses.get(tenant.name, response_id)
    if kept is None:
        raise not_stored(response_id)
    return kept


async def _events(first, replies: AsyncIterator, output: ResponseOutput, keep) -> AsyncIterator[str]:
    """The stream: created, in progress, each reply's events, the closing ones; an error after the start comes
    as an `error` event."""
    try:
        for event in [*output.start(), *output.events(first)]:
            yield _sse(event)
        async for reply in replies:
            for event in output.events(reply):
                yield _sse(event)
        for event in output.end():
            yield _sse(event)
        keep()
    except PagedServeError as err:
        log.info("stream_failed", code=err.code.name, error=str(err))
        refusal = from_gateway(err, RENAMES)
        yield _sse(output.failed(refusal.code, refusal.message, refusal.param))
    finally:
        await replies.aclose()


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _assistant(output: ResponseOutput) -> generation_pb2.ChatMessage:
    """The response's output as the assistant message of its conversation."""
    message = generation_pb2.ChatMessage(role="assistant", content=output.text())
    for call in output.calls():
        message.tool_calls.add(id=call["call_id"], name=call["name"], arguments=call["arguments"])
    return message
