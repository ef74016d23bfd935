"""POST /v1/embeddings, OpenAI's body and response (vLLM's `priority` besides): the body checked and
translated into an EmbedRequest, served by the gRPC front's path (gateway.embedding), and each embedding
returned as a list of floats or, with `encoding_format` "base64", as the base64 of its little-endian float32
bytes (what OpenAI's Python client asks for by default and decodes). `model` names the base model or one
of its LoRA adapters, as for completions (gateway.http.lora_api)."""

import base64
import time
import uuid
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from common.errors import PagedServeError
from gateway.http.bridge import unless_disconnected
from gateway.http.lora_api import adapter_of
from gateway.http.openai_request import Int32, _Body, parse
from protos import generation_pb2

# The gateway's field under its OpenAI name (messages too: `inputs[2] is empty` reads `input[2] is empty`).
RENAMES = {"inputs": "input"}


class EmbeddingRequest(_Body):
    input: str | list[str] | list[Int32] | list[list[Int32]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int32 | None = None
    user: str | None = None
    # vLLM's
    priority: Int32 = 0


def embed_request(body: EmbeddingRequest, request_id: str) -> generation_pb2.EmbedRequest:
    """The body as the gateway's EmbedRequest: one input per string or list of token ids (a flat list of
    ids is one input)."""
    given = body.input
    items = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else given
    inputs = [
        generation_pb2.EmbedInput(text=item)
        if isinstance(item, str)
        else generation_pb2.EmbedInput(token_ids=item)
        for item in items
    ]
    request = generation_pb2.EmbedRequest(request_id=request_id, inputs=inputs, priority=body.priority)
    if body.dimensions is not None:
        request.dimensions = body.dimensions
    return request


def rendered(reply: generation_pb2.EmbedResponse, encoding: str) -> dict:
    """OpenAI's embeddings response (vLLM's id and created besides)."""
    usage = reply.usage.prompt_tokens
    return {
        "id": f"embd-{reply.request_id or uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": reply.model,
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(item.values, encoding)}
            for i, item in enumerate(reply.embeddings)
        ],
        "usage": {"prompt_tokens": usage, "total_tokens": usage},
    }


def _encoded(values, encoding: str) -> list[float] | str:
    if encoding == "float":
        return list(values)
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


async def embeddings(front, request: Request, request_id: str, body: object) -> Response:
    """One embeddings request of `front` (gateway.http.openai_api.Front); refusals are raised."""
    tenant = front.generation.edge.authenticate(request.headers.items())
    parsed = parse(EmbeddingRequest, body)
    name = front.generation.model_name(front.generation.attached_model())
    embed = embed_request(parsed, request_id)
    embed.lora_adapter = adapter_of(front, parsed.model, name)
    call = front.bridge.embed(embed, tenant)
    try:
        reply = await unless_disconnected(request, call)
    except PagedServeError as err:
        message = str(err)
        if not message.startswith("inputs"):
            raise
        raise type(err)("input" + message.removeprefix("inputs")) from None
    return JSONResponse(rendered(reply, parsed.encoding_format), headers={"x-request-id": reply.request_id})
