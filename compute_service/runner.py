"""One packed step: ForwardBatch -> paged forward of the unmodified model -> sampled tokens."""

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from common.errors import InvalidArgument
from compute_service import architectures, kernels, prompt_logprobs
from compute_service.attention.block_summaries import BlockSummaries
from compute_service.attention.context import build_context, reset_context, set_context
from compute_service.attention.kv_codec import NO_SCALES, KVScales
from compute_service.attention.sparse import SparseDecode
from compute_service.batch import ForwardBatch
from compute_service.greedy import greedy, is_plain_greedy
from compute_service.lora.adapters import Adapters
from compute_service.lora.layers import StepRows, set_rows
from compute_service.plan import ExecutionPlan
from compute_service.pool_layout import PoolLayout
from compute_service.pooling import pool
from compute_service.prompt_logprobs import PromptScores
from compute_service.sampling import Sampled, sample
from compute_service.shard_group import DETACH, STEP, ShardGroup


@dataclass(slots=True)
class StepTimes:
    """Where a step's time went inside compute, in seconds."""

    prepare: float = 0.0  # request -> tensors, validation, attention metadata
    model: float = 0.0  # the model's forward and output projection, attention included
    attention: float = 0.0  # the attention function, summed over layers
    sample: float = 0.0
    encoder: float = 0.0  # the vision encoder (inside prepare)
    images_encoded: int = 0
    image_cache_hits: int = 0
    image_store_reads: int = 0  # of image_cache_hits, those read from the pool's image store
    # decodes that attended block-sparse (not a time: counted with them, for the step's reply)
    sparse_rows: int = 0


class Runner:
    """Runs steps of one model on the attached pool; keeps the per-layer pool views between steps."""

    def __init__(
        self,
        model: PreTrainedModel,
        scales: KVScales = NO_SCALES,
        plan: ExecutionPlan | None = None,
        pooling: str = "",
        adapters: Adapters | None = None,
        group: ShardGroup | None = None,
    ) -> None:
        """`plan`: the model's execution plan, whose `sampling.greedy` choice this follows (None: torch's);
        `pooling`: how rows that ask for it are pooled (compute_service.pooling; empty: the model does not
        pool); `adapters`: the model's resident LoRA adapters (None: LoRA off, rows naming one refused);
        `group`: the tensor-parallel group whose rank 0 this is (compute_service.shard_group; None: one
        process), each step and detach sent to the other ranks first."""
        self.model = model
        self.adapters = adapters
        self.group = group
        self.pooling = pooling
        # a scoring model's score weight [1, hidden] (compute_service.scoring), applied to the pooled rows
        self.score: torch.Tensor | None = None
        self.scales = scales
        self.kernels = kernels.load() if plan is not None and plan.native_greedy else None
        self.layers = architectures.layer_attention(model.config)
        self.final_softcap = architectures.final_softcap(model.config)
        # a vision-language model's encoder (compute_service.vision; None: a text model)
        self.vision = getattr(model, "vision", None)
        self.sparse = None if plan is None else plan.sparse_attention
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        # each layer's KV group on a pool of several (compute_service.pool_layout); empty: one group
        self.layer_groups: tuple[int, ...] = ()
        # the attached pool's block summaries, under --sparse-attention (compute_service.attention.sparse)
        self.summaries: BlockSummaries | None = None

    def attach(self, pool: torch.Tensor, layout: PoolLayout | None = None) -> None:
        """pool [layer slots, 2, num_blocks, block_size, num_kv_heads, head_dim], geometry and `layout` (its
        KV groups; None: one group, a slot per layer) already checked; under --sparse-attention its block
        summaries start anew, none current."""
        slots = layout.slots if layout is not None else range(len(pool))
        self.k_caches = [pool[slot, 0] for slot in slots]
        self.v_caches = [pool[slot, 1] for slot in slots]
        self.layer_groups = layout.groups if layout is not None and layout.num_groups > 1 else ()
        if self.sparse is not None:
            full = tuple(i for i, layer in enumerate(self.layers) if not layer.window)
            self.summaries = BlockSummaries(self.k_caches, full)

    def detach(self) -> None:
        """Drops the per-layer views: the pool is unmapped once the caller holds no tensor of it either."""
        if self.group is not None:
            self.group.send((DETACH,))
        self.k_caches, self.v_caches, self.summaries, self.layer_groups = [], [], None, ()

    def logits(self, batch: ForwardBatch, times: StepTimes | None = None) -> torch.Tensor:
        """Float32 logits [S, V] at the last new token of each sequence with `sample` set, in order."""
        return self.outputs(batch, times)[0]

    @torch.inference_mode()
    def outputs(
        self, batch: ForwardBatch, times: StepTimes | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, PromptScores | None]:
        """The logits (see `logits`), the pooled hidden states [P, hidden] float32 of the sequences in
        `pool_rows`, in order (None when no row pools), and the scores of the step's prompt targets (None:
        none asked), all from the same forward."""
        times = times or StepTimes()
        if self.group is None:
            hidden = self.hidden(batch, times)
        else:
            with self.group.in_step():
                self.group.send((STEP, batch))
                hidden = self.hidden(batch, times)
        start = time.perf_counter()
        pooled = pool(self.pooling, hidden, batch.cu_seqlens_q, batch.pool_rows) if batch.pool_rows else None
        if pooled is not None and self.score is not None:
            pooled = pooled @ self.score.T
        prompt = None
        if batch.prompt_targets is not None:
            prompt = prompt_logprobs.score(hidden, self._head, batch.prompt_targets)
        if batch.logit_tokens is not None:
            hidden = hidden[batch.logit_tokens.to(hidden.device)]
        logits = self._head(hidden).float().cpu()
        times.model += time.perf_counter() - start
        return logits, pooled, prompt

    @torch.inference_mode()
    def hidden(self, batch: ForwardBatch, times: StepTimes | None = None) -> torch.Tensor:
        """The model's last hidden states [T, hidden] of the step's tokens, their K/V written to the pool;
        `times` gains the split."""
        assert self.k_caches, "no pool attached"
        times = times or StepTimes()
        start = time.perf_counter()
        rows = self._adapter_rows(batch)
        context = build_context(
            self.k_caches,
            self.v_caches,
            batch,
            self.scales,
            self.layers,
            self._sparse(batch),
            self.layer_groups,
        )
        inputs = self._inputs(batch, times)
        set_context(context)
        set_rows(rows)
        built = time.perf_counter()
        try:
            # NOTE: the step's metadata stays on the cpu (backends move what their kernels read, once).
            hidden = self.model.model(
                **inputs, position_ids=batch.positions[None].to(self.model.device), use_cache=False
            ).last_hidden_state[0]
        finally:
            reset_context()
            set_rows(None)
        times.prepare += built - start
        times.model += time.perf_counter() - built
        times.attention += context.attention_s
        if context.sparse is not None and context.sparse.derived is not None:
            times.sparse_rows += context.sparse.derived.rows
        return hidden

    def _adapter_rows(self, batch: ForwardBatch) -> StepRows | None:
        """The step's rows grouped by LoRA adapter (None: all the base's); InvalidArgument for rows naming an
        adapter that is not resident."""
        if batch.lora_ids is None:
            return None
        if self.adapters is None:
            if batch.lora_ids.any():
                raise InvalidArgument(
                    "lora_ids name adapters, but compute serves none: start it with --enable-lora"
                )
            return None
        return self.adapters.rows(batch.lora_ids, batch.cu_seqlens_q)

    def _inputs(self, batch: ForwardBatch, times: StepTimes) -> dict[str, torch.Tensor]:
        """The model's input: the token ids, or with images their embeddings, the images' written in."""
        token_ids = batch.token_ids[None].to(self.model.device)
        if not batch.images:
            return {"input_ids": token_ids}
        embed = self.model.model.get_input_embeddings()(token_ids)
        encoded, hits, reads, seconds = self.vision.embeddings(batch.images, embed[0])
        times.images_encoded, times.image_cache_hits = (
            times.images_encoded + encoded,
            times.image_cache_hits + hits,
        )
        times.image_store_reads += reads
        times.encoder += seconds
        return {"inputs_embeds": embed}

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits of hidden states, in its dtype."""
        logits = self.model.lm_head(hidden)
        if self.final_softcap:
            # as transformers' causal LM heads (Gemma 2) cap them, in the model's dtype
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _sparse(self, batch: ForwardBatch) -> SparseDecode | None:
        """The step's block-sparse decode (None: every row dense); the summaries of the blocks the step
        writes, and of a cached prefix the cache found for a row, are no longer current. Rows the request
        says nothing of decode as --sparse-attention's default."""
        summaries = self.summaries
        if summaries is None or self.sparse is None:
            return None
        groups = batch.group_tables or (batch.block_tables,)
        for slots in batch.group_slots or (batch.slot_mapping,):
            summaries.written(slots)
        for row in batch.cached_prefix_rows:
            computed = int(batch.context_lens[row]) - int(batch.cu_seqlens_q.diff()[row])
            for tables in groups:
                summaries.forget(tables[row, : -(-computed // summaries.block_size)])
        rows = batch.sparse or [self.sparse.for_request(None)] * len(batch.context_lens)
        if not any(rows):
            return None
        # NOTE: a block id holds one group's layers at a time; only the sparse layers' groups are summarised.
        sparse_groups = (
            sorted({self.layer_groups[layer] for layer in summaries.slot}) if self.layer_groups else []
        )
        return SparseDecode(rows, summaries, batch.prompt_chunks, tuple(groups[g] for g in sparse_groups))

    def forward(self, batch: ForwardBatch, times: StepTimes | None = None) -> Sampled:
        """The sampled token (and log-probabilities) of each sequence with `sample` set, in order, the pooled
        hidden states of those in `pool_rows` and the step's prompt scores; `times` gains the split."""
        times = times or StepTimes()
        logits, pooled, prompt = self.outputs(batch, times)
        start = time.perf_counter()
        if is_plain_greedy(batch.sampling):
            result = greedy(logits, self.kernels)
        else:
            # the sampled token takes the position right after the sequence's context
            result = sample(logits, batch.sampling, batch.context_lens[batch.sample])
        times.sample += time.perf_counter() - start
        result.pooled, result.prompt = pooled, prompt
        return result
