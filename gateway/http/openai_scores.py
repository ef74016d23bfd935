"""POST /v1/score (vLLM's `text_1`/`text_2`) and POST /v1/rerank (the Jina/Cohere shape vLLM serves: `query`,
`documents`, `top_n`, `return_documents`): each body checked and translated into a ScoreRequest, served by
the gRPC front's path (gateway.scoring). `model` names the base model or one of its LoRA adapters."""

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.http.bridge import unless_disconnected
from gateway.http.errors import HttpError
from gateway.http.lora_api import adapter_of
from gateway.http.openai_request import Int32, _Body, parse
from protos import generation_pb2

# The gateway's fields under their API names, per route.
SCORE_RENAMES = {"inputs": "text_2", "queries": "text_1", "documents": "text_2"}
RERANK_RENAMES = {"inputs": "documents", "queries": "query"}


class ScoreBody(_Body):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: Int32 = 0


class RerankBody(_Body):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: Int32 | None = None
    return_documents: bool = True
    priority: Int32 = 0


async def score(front, request: Request, request_id: str, body: object) -> Response:
    """vLLM's score response: one `{"index", "object": "score", "score"}` per pair, in order."""
    parsed = parse(ScoreBody, body)
    texts = [[text] if isinstance(text, str) else text for text in (parsed.text_1, parsed.text_2)]
    reply = await _scores(front, request, request_id, parsed, *texts)
    data = [{"index": i, "object": "score", "score": value} for i, value in enumerate(reply.scores)]
    return _json(reply, {"object": "list", "data": data, "usage": _usage(reply, prompt=True)})


async def rerank(front, request: Request, request_id: str, body: object) -> Response:
    """vLLM's rerank response: `results` by relevance, highest first, `top_n` of them (all when unset),
    each with its `index` in `documents`, its `relevance_score` and, unless return_documents is false, its
    `document` {"text"}."""
    parsed = parse(RerankBody, body)
    if parsed.top_n is not None and parsed.top_n < 1:
        message = f"top_n is {parsed.top_n}; give 1 or more, or leave it unset"
        raise HttpError(400, message, "invalid_request_error", "top_n")
    reply = await _scores(front, request, request_id, parsed, [parsed.query], parsed.documents)
    order = sorted(range(len(reply.scores)), key=lambda i: -reply.scores[i])[: parsed.top_n]
    results = [
        {
            "index": i,
            "relevance_score": reply.scores[i],
            **({"document": {"text": parsed.documents[i]}} if parsed.return_documents else {}),
        }
        for i in order
    ]
    return _json(reply, {"results": results, "usage": _usage(reply, prompt=False)})


async def _scores(front, request: Request, request_id: str, parsed, queries, documents):
    tenant = front.generation.edge.authenticate(request.headers.items())
    name = front.generation.model_name(front.generation.attached_model())
    scored = generation_pb2.ScoreRequest(
        request_id=request_id,
        queries=queries,
        documents=documents,
        priority=parsed.priority,
        lora_adapter=adapter_of(front, parsed.model, name),
    )
    return await unless_disconnected(request, front.bridge.score(scored, tenant))


def _usage(reply: generation_pb2.ScoreResponse, prompt: bool) -> dict:
    tokens = reply.usage.prompt_tokens
    return {"prompt_tokens": tokens, "total_tokens": tokens} if prompt else {"total_tokens": tokens}


def _json(reply: generation_pb2.ScoreResponse, body: dict) -> Response:
    created = {"id": f"score-{reply.request_id or uuid.uuid4().hex}", "model": reply.model}
    return JSONResponse(
        {**created, "created": int(time.time()), **body}, headers={"x-request-id": reply.request_id}
    )
