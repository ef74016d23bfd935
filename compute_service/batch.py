"""The forward batch: a checked ForwardRequest and everything compute derives from it, once per step."""

from dataclasses import dataclass, field, replace

import torch

from common import paging
from common.errors import InvalidArgument
from common.sparse_settings import SparseAttention
from compute_service.prompt_logprobs import PromptTargets, targets
from compute_service.sampling import SamplingBatch
from compute_service.validation import Limits, Sent, check_sent, check_writes, row_of_token
from compute_service.vision import StepImage, step_images
from protos import compute_pb2


@dataclass(slots=True)
class ForwardBatch:
    """Every tensor a step needs (int64 unless noted), read by the attention context, the runner and sampling.

    T new tokens of N sequences; `positions`, `context_lens` and `slot_mapping` are derived here and nowhere
    else. On a pool of several KV groups `block_tables` and `slot_mapping` are group 0's, and `group_tables`,
    `group_slots` every group's (`by_group` gives the batch each group's layers see)."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] pool slot its K/V go to
    cu_seqlens_q: torch.Tensor  # [N + 1] offsets of each sequence's new tokens
    context_lens: torch.Tensor  # [N] tokens in its KV after this step (computed + new)
    block_tables: torch.Tensor  # [N, W], -1 padded
    sample: torch.Tensor  # [N] bool
    sampling: SamplingBatch
    prompt_rows: list[int]  # the sequences with more than one new token (a prompt or a chunk of one)
    # the sequences whose computed tokens' K/V the cache found rather than this compute wrote (cached_prefix)
    cached_prefix_rows: list[int]
    # [N] bool: the sequences whose new tokens are prompt tokens, however few (prompt_chunk); None: no row
    prompt_chunks: torch.Tensor | None
    # per sequence, its block-sparse settings (None: dense); None: each as the stack's default (sparse)
    sparse: list[SparseAttention | None] | None
    # [S] the token whose logits each sampling sequence samples from (its last new one); None when that is
    # every token (a step of decodes that all sample)
    logit_tokens: torch.Tensor | None
    # the sequences whose hidden states are pooled (ForwardRequest.pool), in order
    pool_rows: list[int]
    # per KV group of the pool: its tables [N, W], the slots of the new tokens in them [T]; empty: one group
    group_tables: tuple[torch.Tensor, ...] = ()
    group_slots: tuple[torch.Tensor, ...] = ()
    # the prompt tokens the step scores (ForwardRequest.prompt_*); None: no row asks
    prompt_targets: PromptTargets | None = None
    # [N] the LoRA adapter id of each sequence (0: the base model); None: every row the base's
    lora_ids: torch.Tensor | None = None
    # the images whose placeholder tokens the step's new tokens cover (compute_service.vision)
    images: list[StepImage] = field(default_factory=list)

    @classmethod
    def from_request(cls, request: compute_pb2.ForwardRequest, limits: Limits) -> "ForwardBatch":
        """The batch of a request; raises InvalidArgument, naming the field, unless the request is a
        well-formed step that writes only inside its sequences' own blocks of the pool."""
        sent = Sent.from_request(request)
        check_sent(sent, limits)
        batch = cls.derive(sent, limits.block_size)
        for slots in batch.group_slots or (batch.slot_mapping,):
            check_writes(slots, batch.cu_seqlens_q)
        fields = (request.prompt_logprobs, request.prompt_target_ids, request.cu_prompt_targets)
        batch.prompt_targets = targets(
            *(torch.tensor(f, dtype=torch.int64) for f in fields), batch.cu_seqlens_q, limits.vocab_size
        )
        if request.lora_ids:
            if len(request.lora_ids) != len(batch.context_lens):
                raise InvalidArgument(
                    f"lora_ids has {len(request.lora_ids)} entries for {len(batch.context_lens)} sequences: "
                    "send one per sequence (0: the base model) or none"
                )
            batch.lora_ids = torch.tensor(request.lora_ids, dtype=torch.int64)
        batch.images = step_images(request, batch.token_ids, limits.image_token_id)
        return batch

    @classmethod
    def derive(cls, sent: Sent, block_size: int) -> "ForwardBatch":
        """Positions, context lengths and slots of a checked request (see compute_service.validation)."""
        cu, width = sent.cu_seqlens_q, sent.block_table_width
        num_tokens, seq_of_token = len(sent.token_ids), row_of_token(cu)
        # new tokens follow the computed ones: token cu[i] + j of sequence i sits at num_computed[i] + j
        positions = torch.arange(num_tokens) + (sent.num_computed - cu[:-1])[seq_of_token]
        # NOTE: a group's tables laid end to end are one table in which position p of sequence i is at
        # i * width * block_size + p, so one gather finds the slots of the packed tokens of all sequences.
        flat = sent.block_tables.view(sent.num_kv_groups, -1)
        at = seq_of_token * (width * block_size) + positions
        slots = tuple(paging.slots(tables, at, block_size) for tables in flat)
        tables = tuple(group.view(-1, width) for group in flat)
        several = len(tables) > 1
        last = cu[1:][sent.sample] - 1
        return cls(
            token_ids=sent.token_ids,
            positions=positions,
            slot_mapping=slots[0],
            cu_seqlens_q=cu,
            context_lens=sent.context_lens(),
            block_tables=tables[0],
            sample=sent.sample,
            sampling=sent.sampling,
            prompt_rows=(cu.diff() > 1).nonzero().squeeze(1).tolist(),
            cached_prefix_rows=sent.cached_prefix.nonzero().squeeze(1).tolist(),
            prompt_chunks=sent.prompt_chunk if sent.prompt_chunk.any() else None,
            sparse=[SparseAttention(*row) if row[2] else None for row in sent.sparse.tolist()]
            if len(sent.sparse)
            else None,
            logit_tokens=None if len(last) == num_tokens else last,
            pool_rows=sent.pool.nonzero().squeeze(1).tolist(),
            group_tables=tables if several else (),
            group_slots=slots if several else (),
        )

    def by_group(self) -> list["ForwardBatch"]:
        """The batch each KV group's layers see: its tables and slots in block_tables and slot_mapping."""
        if not self.group_tables:
            return [self]
        return [
            replace(self, block_tables=tables, slot_mapping=slots, group_tables=(), group_slots=())
            for tables, slots in zip(self.group_tables, self.group_slots, strict=True)
        ]

    def following(self, tokens: torch.Tensor, keep: list[int], block_size: int) -> "ForwardBatch":
        """The decode step after this one, an all-decode step of sampling rows, for its rows `keep` (indices,
        ascending): each feeds the token it sampled (`tokens` [N]), one position on, into the slot its table
        holds there. Unchecked: its caller verified every row's reach up front
        (compute_service.multi_step)."""
        rows = None if len(keep) == len(tokens) else torch.tensor(keep)

        def pick(values: torch.Tensor) -> torch.Tensor:
            return values if rows is None else values[rows]

        positions = pick(self.positions) + 1
        groups = tuple(pick(tables) for tables in self.group_tables or (self.block_tables,))
        slots = tuple(paging.slots(tables, positions[:, None], block_size)[:, 0] for tables in groups)
        several = len(groups) > 1
        return ForwardBatch(
            token_ids=pick(tokens),
            positions=positions,
            slot_mapping=slots[0],
            cu_seqlens_q=self.cu_seqlens_q if rows is None else torch.arange(len(keep) + 1),
            context_lens=pick(self.context_lens) + 1,
            block_tables=groups[0],
            sample=pick(self.sample),
            sampling=self.sampling.following(tokens, rows),
            prompt_rows=[],
            cached_prefix_rows=[],
            prompt_chunks=None,
            sparse=None if self.sparse is None else [self.sparse[row] for row in keep],
            logit_tokens=None,
            pool_rows=[],
            group_tables=groups if several else (),
            group_slots=slots if several else (),
            lora_ids=None if self.lora_ids is None else pick(self.lora_ids),
        )
