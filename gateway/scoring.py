"""Scores of (query, document) pairs from a scoring model (docs/embeddings.md, Scores): gRPC Score, POST
/v1/score and /v1/rerank. Each pair is tokenized as the tokenizer encodes a text pair (what a cross-encoder
is trained on, as vLLM's score route encodes it) and runs as an embedding input of its own (gateway.embedding:
the same scheduling, limits and refusals); compute returns the classifier's logit on its last token, whose
sigmoid is the score."""

import math

from common.errors import InvalidArgument
from gateway.auth import Tenant
from gateway.embedding import Embeddings
from gateway.generation import OnEnd
from gateway.limits import flag
from protos import generation_pb2


class Scores:
    """Serves Score on the embedding path."""

    def __init__(self, embeddings: Embeddings) -> None:
        self.embeddings = embeddings

    def score(
        self, request: generation_pb2.ScoreRequest, tenant: Tenant, on_end: OnEnd
    ) -> generation_pb2.ScoreResponse:
        """One score per pair, in order; InvalidArgument for pairs that do not match or a model that
        cannot score, else the embedding path's refusals."""
        self.embeddings.pooling(scoring=True)
        queries, documents = list(request.queries), list(request.documents)
        if not documents:
            raise InvalidArgument("documents is empty: give one or more to score")
        if len(queries) not in (1, len(documents)):
            raise InvalidArgument(
                f"queries has {len(queries)} entries for {len(documents)} documents: give one query, or one "
                "per document"
            )
        generation = self.embeddings.generation
        queries = queries * len(documents) if len(queries) == 1 else queries
        limit = generation.edge.limits.prompt_bytes(generation.attached_model().max_model_len)
        for i, (query, document) in enumerate(zip(queries, documents, strict=True)):
            if len(query.encode()) + len(document.encode()) > limit:
                raise InvalidArgument(
                    f"pair {i} has more than {limit} bytes; the limit is {limit} ({flag('max_prompt_bytes')})"
                )
        inputs = [
            generation_pb2.EmbedInput(token_ids=generation.tokenizer(query, document)["input_ids"])
            for query, document in zip(queries, documents, strict=True)
        ]
        embed = generation_pb2.EmbedRequest(
            request_id=request.request_id,
            inputs=inputs,
            priority=request.priority,
            lora_adapter=request.lora_adapter,
        )
        reply = self.embeddings.embed(embed, tenant, on_end, scoring=True)
        return generation_pb2.ScoreResponse(
            request_id=reply.request_id,
            model=reply.model,
            # the sigmoid, as tanh: no overflow for any logit
            scores=[0.5 * (1 + math.tanh(item.values[0] / 2)) for item in reply.embeddings],
            usage=reply.usage,
        )
