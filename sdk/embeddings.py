"""The SDK's embeddings: `Client.embed(inputs)` sends one Embed call (docs/embeddings.md) and returns an
`Embeddings`, one vector per input in order; `Client.score(query, documents)` sends one Score call and returns
`Scores`, one per document in order."""

from collections.abc import Sequence
from dataclasses import dataclass

from protos import generation_pb2

# A text, a list of texts, a list of token ids (one input), or a list of such lists.
Inputs = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class EmbedUsage:
    prompt_tokens: int
    # Tokens whose KV was reused (last-token pooling shares the prefix cache).
    cached_tokens: int


@dataclass(frozen=True)
class Embeddings:
    request_id: str
    model: str
    vectors: list[list[float]]
    usage: EmbedUsage


def embed_request(
    inputs: Inputs,
    dimensions: int | None = None,
    priority: int = 0,
    request_id: str = "",
    lora_adapter: str = "",
) -> generation_pb2.EmbedRequest:
    """The EmbedRequest of `inputs`: a string or a list of token ids is one input, a list of those several;
    `lora_adapter` embeds them through that LoRA adapter (docs/adapters.md), else the base model."""
    single = isinstance(inputs, str) or (len(inputs) > 0 and isinstance(inputs[0], int))
    items = [inputs] if single else list(inputs)
    request = generation_pb2.EmbedRequest(
        request_id=request_id,
        inputs=[
            generation_pb2.EmbedInput(text=item)
            if isinstance(item, str)
            else generation_pb2.EmbedInput(token_ids=list(item))
            for item in items
        ],
        priority=priority,
        lora_adapter=lora_adapter,
    )
    if dimensions is not None:
        request.dimensions = dimensions
    return request


def to_embeddings(reply: generation_pb2.EmbedResponse) -> Embeddings:
    return Embeddings(
        request_id=reply.request_id,
        model=reply.model,
        vectors=[list(item.values) for item in reply.embeddings],
        usage=EmbedUsage(reply.usage.prompt_tokens, reply.usage.cached_tokens),
    )


@dataclass(frozen=True)
class Scores:
    request_id: str
    model: str
    # One per (query, document) pair, in order: in (0, 1), higher is more relevant.
    scores: list[float]
    usage: EmbedUsage


def score_request(
    query: str | Sequence[str],
    documents: str | Sequence[str],
    priority: int = 0,
    request_id: str = "",
    lora_adapter: str = "",
) -> generation_pb2.ScoreRequest:
    """The ScoreRequest of one query against each document, or of queries and documents pairwise."""
    return generation_pb2.ScoreRequest(
        request_id=request_id,
        queries=[query] if isinstance(query, str) else list(query),
        documents=[documents] if isinstance(documents, str) else list(documents),
        priority=priority,
        lora_adapter=lora_adapter,
    )


def to_scores(reply: generation_pb2.ScoreResponse) -> Scores:
    usage = EmbedUsage(reply.usage.prompt_tokens, reply.usage.cached_tokens)
    return Scores(reply.request_id, reply.model, list(reply.scores), usage)
