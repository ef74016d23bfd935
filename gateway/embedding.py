"""One embeddings path for every public front (gRPC Embed, POST /v1/embeddings): an EmbedRequest in, an
EmbedResponse out. Each input is a sequence of its own that the engine schedules as a prompt beside the
generations (packed into the same steps, under the same token and sequence budgets), pooled by compute
as the model declares (gateway.pooled); here its embedding is truncated to the request's dimensions and
normalised where the model normalises. A request may name a LoRA adapter (`lora_adapter`): its inputs run
through it as a generation's prompt does (docs/adapters.md).

A request holds one stream slot (--max-streams, --max-streams-per-key) while it runs, its inputs count
against the waiting queue (--max-waiting), and it may hold at most --max-embed-inputs inputs, each within
the model's length and --max-prompt-bytes.
"""

import uuid

import numpy as np
import structlog

from common.errors import InvalidArgument, ResourceExhausted
from gateway.auth import Tenant, salted
from gateway.generation import Generation, OnEnd
from gateway.limits import check_queue, check_request_id, flag
from gateway.outputs import Output
from gateway.sequence import Sampling, Sequence
from protos import common_pb2, compute_pb2, generation_pb2

log = structlog.get_logger()


class Embeddings:
    """Serves Embed on the generation path's engine, tokenizer, admission gate, slots and edge."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    def pooling(self, scoring: bool = False) -> compute_pb2.Pooling:
        """The attached model's pooling; InvalidArgument (naming `model`) where it does not pool, or where
        it scores (a sequence classifier) and `scoring` is not set, or the reverse."""
        info = self.generation.attached_model()
        scores = info.pooling.source == "score"
        if scoring and not scores:
            raise InvalidArgument(
                f"model {info.model} cannot score: scores come from a sequence-classification model of one "
                "label (a cross-encoder or reranker, *ForSequenceClassification in its config.json), or a "
                "causal LM served with --classifier-from-token"
            )
        if scores and not scoring:
            raise InvalidArgument(
                f"model {info.model} is served as a scoring model: it serves scores (POST /v1/score, "
                "/v1/rerank, gRPC Score), not embeddings"
            )
        if not info.pooling.type:
            raise InvalidArgument(
                f"model {info.model} does not pool, so it serves no embeddings: it declares no pooling (a "
                "sentence-transformers modules.json) and compute runs with --pooling auto or off; serve an "
                "embedding model, or start compute with --pooling last (mean, cls) to pool this one"
            )
        return info.pooling

    def embed(
        self, request: generation_pb2.EmbedRequest, tenant: Tenant, on_end: OnEnd, scoring: bool = False
    ) -> generation_pb2.EmbedResponse:
        """The request's embeddings, one per input in order (`scoring`: a scoring model's logits, one
        value each: gateway.scoring); raises its error (a refusal before anything is queued, or the failure
        of any of its inputs, which ends them all)."""
        generation = self.generation
        with generation.slots.hold(), generation.edge.stream_slot(tenant):
            pooling = self.pooling(scoring)
            dimensions = _dimensions(request, pooling)
            adapter = generation.adapters.resolve(request.lora_adapter)
            request_id = request.request_id or structlog.contextvars.get_contextvars().get("request_id", "")
            check_request_id(request_id, generation.edge.limits)
            request_id = request_id or uuid.uuid4().hex
            structlog.contextvars.bind_contextvars(request_id=request_id)
            seqs = self._sequences(request, request_id, tenant, pooling.type, adapter)
            generation.admission.enter(seqs[0])
            on_end(lambda: generation.admission.leave(seqs[0].seq_id))
            log.info("embed", inputs=len(seqs), prompt_tokens=sum(len(seq.prompt_ids) for seq in seqs))
            # NOTE: the abort first: an engine that stops taking inputs part-way leaves none of them running.
            on_end(lambda: generation.engine.abort(seqs[0].group_id))
            for seq in seqs:
                generation.engine.submit(seq)
            embeddings = _gather(seqs)
        return generation_pb2.EmbedResponse(
            request_id=request_id,
            model=adapter.name if adapter else generation.model_name(generation.attached_model()),
            embeddings=[
                generation_pb2.Embedding(values=_finish(vector, dimensions, pooling.normalize).tolist())
                for vector in embeddings
            ],
            usage=generation_pb2.EmbedUsage(
                prompt_tokens=sum(len(seq.prompt_ids) for seq in seqs),
                cached_tokens=sum(seq.cached_tokens for seq in seqs),
            ),
        )

    def _sequences(
        self,
        request: generation_pb2.EmbedRequest,
        request_id: str,
        tenant: Tenant,
        mode: str,
        adapter: common_pb2.LoraAdapter | None,
    ) -> list[Sequence]:
        """One sequence per input, all of one request (group) with one outbox, run through `adapter` (None:
        the base model); refused before tokenizing beyond the input count or the queue, and at the first
        input beyond the limits."""
        generation, limits = self.generation, self.generation.edge.limits
        count = len(request.inputs)
        if not 0 < count <= limits.max_embed_inputs:
            raise InvalidArgument(
                f"inputs has {count} entries; send from 1 to {limits.max_embed_inputs} "
                f"({flag('max_embed_inputs')})"
            )
        check_queue(generation.engine.queued() + count - 1, limits)
        info = generation.attached_model()
        prompts = [self._tokens(i, item, info) for i, item in enumerate(request.inputs)]
        group = uuid.uuid4().hex
        first = Sequence(
            seq_id=group,
            prompt_ids=prompts[0],
            sampling=Sampling(max_tokens=1),
            max_len=generation.engine.max_len,
            request_id=request_id,
            cache_salt=salted(tenant, ""),
            tenant=tenant.name,
            priority=request.priority,
            pooling=mode,
            lora_id=adapter.id if adapter else 0,
            lora_name=adapter.name if adapter else "",
        )
        return [first, *(first.sample(i, prompt_ids=ids) for i, ids in enumerate(prompts[1:], 1))]

    def _tokens(self, i: int, item: generation_pb2.EmbedInput, info: compute_pb2.ModelInfo) -> list[int]:
        """Input i's token ids: its text tokenized with the model's special tokens (as sentence-transformers
        tokenizes), or its token ids; InvalidArgument naming it when empty, both or neither, too long, or
        outside the vocabulary."""
        limit = self.generation.edge.limits.prompt_bytes(info.max_model_len)
        if item.text and item.token_ids:
            raise InvalidArgument(f"inputs[{i}] sets both text and token_ids: set one")
        if len(item.text) > limit or len(item.text.encode()) > limit:
            raise InvalidArgument(
                f"inputs[{i}] has more than {limit} bytes; the limit is {limit} ({flag('max_prompt_bytes')})"
            )
        ids = list(item.token_ids) or (self.generation.tokenizer(item.text)["input_ids"] if item.text else [])
        if not ids:
            raise InvalidArgument(f"inputs[{i}] is empty: give it text or token ids")
        if any(not 0 <= token < info.vocab_size for token in ids):
            raise InvalidArgument(
                f"inputs[{i}] holds token ids outside the vocabulary [0, {info.vocab_size})"
            )
        if len(ids) > info.max_model_len:
            raise InvalidArgument(
                f"inputs[{i}] has {len(ids)} tokens; the model takes at most {info.max_model_len}"
            )
        max_len = self.generation.engine.max_len
        if len(ids) > max_len:
            raise ResourceExhausted(
                f"inputs[{i}] has {len(ids)} tokens; the KV cache holds at most {max_len} tokens per "
                "sequence: give the cache service more memory (--kv-memory/--kv-blocks)"
            )
        return ids


def _dimensions(request: generation_pb2.EmbedRequest, pooling: compute_pb2.Pooling) -> int | None:
    """The width asked for (None: the model's); InvalidArgument naming `dimensions` where the model cannot
    truncate to it."""
    if not request.HasField("dimensions") or request.dimensions == pooling.dimensions:
        return None
    asked, widths = request.dimensions, list(pooling.matryoshka_dimensions)
    if not pooling.matryoshka:
        raise InvalidArgument(
            f"dimensions is {asked}, but the model's embeddings are {pooling.dimensions} wide and it does "
            "not declare Matryoshka truncation (is_matryoshka or matryoshka_dimensions in its config.json): "
            "leave dimensions unset"
        )
    if widths and asked not in widths:
        raise InvalidArgument(f"dimensions is {asked}; the model truncates to one of {widths}")
    if not 0 < asked <= pooling.dimensions:
        raise InvalidArgument(f"dimensions is {asked}; the model's embeddings take 1 to {pooling.dimensions}")
    return asked


def _gather(seqs: list[Sequence]) -> list[np.ndarray]:
    """Every input's pooled vector, by index, as the engine ends them; raises the first error."""
    vectors: dict[int, np.ndarray] = {}
    while len(vectors) < len(seqs):
        item = seqs[0].outbox.get()
        if isinstance(item, Exception):
            raise item
        assert isinstance(item, Output) and item.embedding is not None, item
        vectors[item.index] = item.embedding
    return [vectors[i] for i in range(len(seqs))]


def _finish(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Truncated to `dimensions` (None: whole), then scaled to unit length where the model normalises (as
    sentence-transformers' Normalize: divided by max(norm, 1e-12))."""
    kept = vector[:dimensions].astype(np.float32)
    if not normalize:
        return kept
    return kept / max(float(np.linalg.norm(kept)), 1e-12)
