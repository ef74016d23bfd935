"""The OpenAI-compatible HTTP API (an installer of the gateway's HTTP app): POST /v1/completions and
/v1/chat/completions (whole, or streamed as server-sent events), POST /v1/embeddings, POST /v1/score and
/v1/rerank (gateway.http.openai_scores), GET /v1/models and /health.

Each request goes through the gRPC front's path: the same API keys (`Authorization: Bearer`) and prefix-
cache namespaces, the edge's limits, the stream slots, the admission gate and the engine
(gateway.generation). Bodies arrive parsed and bounded (gateway.http.body).
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import structlog
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.errors import PagedServeError
from gateway.http import lora_api, openai_embeddings, openai_scores
from gateway.http.app import Installer
from gateway.http.body import request_json
from gateway.http.bridge import Bridge, EventStream, unless_disconnected
from gateway.http.errors import HttpError, from_gateway, invalid
from gateway.http.guard import REQUEST_ID_HEADER, guarded
from gateway.http.image_parts import DATA_ONLY, MediaSources, has_images
from gateway.http.openai_request import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    completion_prompts,
    completion_request,
    parse,
)
from gateway.http.openai_response import DONE, Rendering, event
from gateway.http.prompt_echo import PromptEcho
from gateway.http.responses.store import ResponseStore
from protos import generation_pb2

log = structlog.get_logger()
# Gateway fields under their chat names (a chat asks for top alternatives with top_logprobs).
CHAT_RENAMES = {
    "logprobs": "top_logprobs",
    "max_tokens": "max_completion_tokens",
    "prompt": "messages",
    "constraint": "response_format",
}
COMPLETION_RENAMES = {"constraint": "response_format", "prompts": "prompt"}


@dataclass
class Front:
    """What the routes serve from: the generation path (through the bridge), the gateway's health, and
    the names a request's `model` may take besides the served model's own (the --model value)."""

    bridge: Bridge
    health: Callable[[], int]
    aliases: frozenset[str] = frozenset()
    started: int = field(default_factory=lambda: int(time.time()))
    # The Responses API's stored responses (previous_response_id).
    responses: ResponseStore = field(default_factory=ResponseStore)
    # Where image URLs may point besides data: (--allowed-local-media-path, --allowed-media-domains).
    media: MediaSources = DATA_ONLY

    @property
    def generation(self):
        return self.bridge.generation


def openai_api(front: Front) -> Installer:
    """The installer of the OpenAI-compatible routes."""

    def install(app: FastAPI) -> None:
        app.include_router(_router(front))
        default = app.exception_handlers[StarletteHTTPException]

        async def openai_errors(request: Request, exc: StarletteHTTPException) -> Response:
            """An unknown path or method under /v1 answers in OpenAI's error JSON too."""
            if not request.url.path.startswith("/v1/"):
                return await default(request, exc)
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            message = f"{request.method} {request.url.path}: {exc.detail}"
            return HttpError(exc.status_code, message, kind, code=kind.removesuffix("_error")).response()

        app.add_exception_handler(StarletteHTTPException, openai_errors)

    return install


def _router(front: Front) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(front, request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answer(front, request, chat=True)

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await guarded(request, lambda rid: _embed(front, request, rid), openai_embeddings.RENAMES)

    @router.post("/v1/score")
    async def score(request: Request) -> Response:
        return await _scored(front, request, openai_scores.score, openai_scores.SCORE_RENAMES)

    @router.post("/v1/rerank")
    async def rerank(request: Request) -> Response:
        return await _scored(front, request, openai_scores.rerank, openai_scores.RERANK_RENAMES)

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        def listed() -> dict:
            card = _card(front, request)
            return {"object": "list", "data": [card, *lora_api.adapter_cards(front, card)]}

        return await _refusing(listed)

    @router.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        def card() -> dict:
            found = _card(front, request)
            if model == found["id"] or model in front.aliases:
                return found
            lora_api.adapter_of(front, model, found["id"])
            return next(card for card in lora_api.adapter_cards(front, found) if card["id"] == model)

        return await _refusing(card)

    @router.get("/health")
    async def health() -> Response:
        """200 only while the gateway's gRPC health answers SERVING (open, like grpc.health.v1)."""
        serving = front.health() == health_pb2.HealthCheckResponse.SERVING
        return JSONResponse({"status": "serving" if serving else "not serving"}, 200 if serving else 503)

    return router


def _card(front: Front, request: Request) -> dict:
    front.generation.edge.authenticate(request.headers.items())
    info = front.generation.attached_model()
    return {
        "id": front.generation.model_name(info),
        "object": "model",
        "created": front.started,
        "owned_by": "pagedserve",
        "max_model_len": info.max_model_len,
    }


async def _refusing(make: Callable[[], dict]) -> Response:
    try:
        return JSONResponse(make())
    except HttpError as err:
        return err.response()
    except PagedServeError as err:
        return from_gateway(err).response()


async def _answer(front: Front, request: Request, chat: bool) -> Response:
    """One completion or chat completion, whole or streamed; any refusal in OpenAI's error JSON."""
    renames = CHAT_RENAMES if chat else COMPLETION_RENAMES
    return await guarded(
        request, lambda request_id: _generate(front, request, request_id, chat, renames), renames
    )


async def _scored(front: Front, request: Request, route, renames: dict) -> Response:
    return await guarded(request, lambda rid: route(front, request, rid, request_json(request)), renames)


async def _embed(front: Front, request: Request, request_id: str) -> Response:
    return await openai_embeddings.embeddings(front, request, request_id, request_json(request))


async def _generate(front: Front, request: Request, request_id: str, chat: bool, renames: dict) -> Response:
    """The request checked and translated, then generated: its first reply awaited before the response
    starts (so that a refusal gets its status), the rest streamed as events or gathered into one object."""
    tenant = front.generation.edge.authenticate(request.headers.items())
    body = parse(ChatRequest if chat else CompletionRequest, request_json(request))
    info = front.generation.attached_model()
    name = front.generation.model_name(info)
    adapter = lora_api.adapter_of(front, body.model, name)
    tokenizer = front.generation.tokenizer
    if chat and has_images(message.content for message in body.messages):
        # NOTE: image URLs are fetched and base64 decoded in a worker thread, not on the event loop.
        proto = await asyncio.to_thread(chat_request, body, request_id, info.max_model_len, front.media)
    elif chat:
        proto = chat_request(body, request_id, info.max_model_len)
    else:
        proto = completion_request(body, request_id)
    proto.lora_adapter = adapter
    n = proto.sampling.n or 1
    prompts = PromptEcho(tokenizer, n, _echoed(body, tokenizer), body.logprobs, body.prompt_logprobs)
    rendering = Rendering(chat, adapter or name, tokenizer, body.return_token_ids, proto.resume, n, prompts)
    replies = front.bridge.replies(proto, tenant)
    if body.stream:
        first = await unless_disconnected(request, anext(replies))
        usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(
            _events(first, replies, rendering, usage, renames), {REQUEST_ID_HEADER: first.request_id}
        )
    gathered = await unless_disconnected(request, gather(replies))
    whole = rendering.whole(gathered, proto.sampling.HasField("logprobs"))
    return JSONResponse(whole, headers={REQUEST_ID_HEADER: rendering.request_id})


def _echoed(body: CompletionRequest | ChatRequest, tokenizer) -> list[str] | None:
    """Each prompt's text as completions' echo shows it (token ids decoded); None without echo."""
    if isinstance(body, ChatRequest) or not body.echo:
        return None
    if body.resume:
        raise invalid("echo cannot be combined with resume: the first stream echoed the prompt", "echo")
    return [p if isinstance(p, str) else tokenizer.decode(p) for p in completion_prompts(body.prompt)]


async def gather(replies: AsyncIterator) -> list[generation_pb2.GenerateResponse]:
    return [reply async for reply in replies]


async def _events(
    first: generation_pb2.GenerateResponse,
    replies: AsyncIterator,
    rendering: Rendering,
    usage: bool,
    renames: dict,
) -> AsyncIterator[str]:
    """The stream's events: a chunk per reply, the usage chunk if asked, `[DONE]`; an error after the
    first chunk comes as an event holding OpenAI's error JSON, then `[DONE]`."""
    try:
        if (chunk := rendering.chunk(first, usage)) is not None:
            yield event(chunk)
        async for reply in replies:
            if (chunk := rendering.chunk(reply, usage)) is not None:
                yield event(chunk)
        if usage:
            yield event(rendering.usage_chunk())
    except PagedServeError as err:
        log.info("stream_failed", code=err.code.name, error=str(err))
        yield event(from_gateway(err, renames).body())
    finally:
        await replies.aclose()
    yield DONE
