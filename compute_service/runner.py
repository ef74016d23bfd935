"""One packed step: ForwardRequest -> tensors -> paged forward of the unmodified model -> sampled tokens."""

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from compute_service.attention.context import build_context, reset_context, set_context
from compute_service.sampling import Sampled, SamplingBatch, sample
from protos import compute_pb2


@dataclass(slots=True)
class Step:
    """The request's fields as int64/bool tensors, unchecked (see compute_service.validation)."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor  # flat, row-major [num_seqs * block_table_width]
    block_table_width: int
    slot_mapping: torch.Tensor
    sample: torch.Tensor
    sampling: SamplingBatch

    @classmethod
    def from_request(cls, request: compute_pb2.ForwardRequest) -> "Step":
        def ints(field) -> torch.Tensor:
            return torch.tensor(field, dtype=torch.int64)

        return cls(
            token_ids=ints(request.token_ids),
            positions=ints(request.positions),
            cu_seqlens_q=ints(request.cu_seqlens_q),
            context_lens=ints(request.context_lens),
            block_tables=ints(request.block_tables),
            block_table_width=request.block_table_width,
            slot_mapping=ints(request.slot_mapping),
            sample=torch.tensor(request.sample, dtype=torch.bool),
            sampling=SamplingBatch.from_request(request),
        )


@dataclass(slots=True)
class StepTimes:
    """Where a step's time went inside compute, in seconds."""

    prepare: float = 0.0  # request -> tensors, validation, attention metadata
    model: float = 0.0  # the model's forward and output projection, attention included
    attention: float = 0.0  # the attention function, summed over layers
    sample: float = 0.0


class Runner:
    """Runs steps of one model on the attached pool; keeps the per-layer pool views between steps."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []

    def attach(self, pool: torch.Tensor) -> None:
        """pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], geometry already checked."""
        self.k_caches = list(pool[:, 0].unbind(0))
        self.v_caches = list(pool[:, 1].unbind(0))

    @torch.inference_mode()
    def logits(self, step: Step, times: StepTimes | None = None) -> torch.Tensor:
        """Float32 logits [S, V] at the last new token of each sequence with `sample` set, in order."""
        assert self.k_caches, "no pool attached"
        times = times or StepTimes()
        start = time.perf_counter()
        tables = step.block_tables.view(-1, step.block_table_width)
        context = build_context(
            self.k_caches, self.v_caches, step.slot_mapping, step.cu_seqlens_q, step.context_lens, tables
        )
        set_context(context)
        built = time.perf_counter()
        try:
            hidden = self.model.model(
                input_ids=step.token_ids[None], position_ids=step.positions[None], use_cache=False
            ).last_hidden_state[0]
        finally:
            reset_context()
        last = step.cu_seqlens_q[1:][step.sample] - 1
        logits = self.model.lm_head(hidden[last]).float()
        times.prepare += built - start
        times.model += time.perf_counter() - built
        times.attention += context.attention_s
        return logits

    def forward(self, step: Step, times: StepTimes | None = None) -> Sampled:
        """The sampled token (and log-probabilities) of each sequence with `sample` set, in order; `times`
        gains the split."""
        times = times or StepTimes()
        logits = self.logits(step, times)
        start = time.perf_counter()
        # the sampled token takes the position right after the sequence's context
        result = sample(logits, step.sampling, step.context_lens[step.sample])
        times.sample += time.perf_counter() - start
        return result
