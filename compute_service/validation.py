"""Checks a Forward request as sent, before anything is derived from it or touches the pool; every refusal
says which field is wrong and how. A refusal caused by some sequences (rows) only is a RowsRefused naming
every row that fails that check, so the caller can drop those and send the rest again."""

import dataclasses
from dataclasses import dataclass

import torch

from common import paging
from common.errors import InvalidArgument, RowsRefused
from common.sparse_settings import SparseMode
from compute_service.sampling import SamplingBatch
from compute_service.sampling_checks import check_sampling
from protos import compute_pb2


@dataclass(frozen=True)
class Limits:
    """What every step must stay within: the model's vocabulary and length, the attached KV pool's blocks and
    KV groups (a table per group and sequence)."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    # --sparse-attention (None: off, no row may ask for block-sparse decode)
    sparse: SparseMode | None = None
    num_groups: int = 1
    # the model's pooling mode (compute_service.pooling; empty: it does not pool, no row may ask)
    pooling: str = ""
    # a vision-language model's image token (None: a text model, no step may carry images)
    image_token_id: int | None = None


@dataclass(slots=True)
class Sent:
    """The request's fields as int64/bool tensors, unchecked."""

    token_ids: torch.Tensor
    cu_seqlens_q: torch.Tensor
    num_computed: torch.Tensor
    block_tables: torch.Tensor  # flat, row-major [num_kv_groups * num_seqs * block_table_width]
    block_table_width: int
    num_kv_groups: int
    sample: torch.Tensor
    sampling: SamplingBatch
    cached_prefix: torch.Tensor  # bool, one per sequence or none
    prompt_chunk: torch.Tensor  # bool, one per sequence or none
    sparse: torch.Tensor  # [N or 0, 3] (sink, recent, topk) per sequence or none
    # bool, one per sequence or none
    pool: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))

    @classmethod
    def from_request(cls, request: compute_pb2.ForwardRequest) -> "Sent":
        def ints(field) -> torch.Tensor:
            return torch.tensor(field, dtype=torch.int64)

        return cls(
            token_ids=ints(request.token_ids),
            cu_seqlens_q=ints(request.cu_seqlens_q),
            num_computed=ints(request.num_computed),
            block_tables=ints(request.block_tables),
            block_table_width=request.block_table_width,
            num_kv_groups=request.num_kv_groups or 1,
            sample=torch.tensor(request.sample, dtype=torch.bool),
            sampling=SamplingBatch.from_request(request),
            cached_prefix=torch.tensor(request.cached_prefix, dtype=torch.bool),
            prompt_chunk=torch.tensor(request.prompt_chunk, dtype=torch.bool),
            sparse=torch.tensor([(r.sink, r.recent, r.topk) for r in request.sparse], dtype=torch.int64).view(
                -1, 3
            ),
            pool=torch.tensor(request.pool, dtype=torch.bool),
        )

    def context_lens(self) -> torch.Tensor:
        """Per sequence: tokens in its KV after this step (computed + new); needs consistent counts."""
        return self.num_computed + self.cu_seqlens_q.diff()


def check_sent(sent: Sent, limits: Limits) -> None:
    """Raises InvalidArgument unless the counts fit together, the token ids are in the vocabulary and every
    context fits the model and has its blocks in its table (in every KV group's), inside the pool."""
    if sent.num_kv_groups != limits.num_groups:
        raise InvalidArgument(
            f"num_kv_groups is {sent.num_kv_groups}, the attached pool has {limits.num_groups} KV groups: "
            "send each sequence's table in every group (the pool handle's kv_groups), group after group"
        )
    _check_counts(sent)
    context_lens = sent.context_lens()
    _check_sequences(sent, context_lens, limits)
    _check_blocks(sent, context_lens, limits)
    _check_sparse(sent.sparse, limits.sparse)
    _check_pool(sent, limits.pooling)
    check_sampling(sent.sampling, limits.vocab_size, sent.sample.nonzero()[:, 0])


def check_reach(sent: Sent, context_lens: torch.Tensor, limits: Limits) -> None:
    """Raises RowsRefused unless every row's context could grow to `context_lens` tokens: within the model's
    length, its blocks in its table, inside the pool (a multi-step decode's last step, checked up front)."""
    _check_sequences(sent, context_lens, limits)
    _check_blocks(sent, context_lens, limits)


def row_of_token(cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """[T] the sequence (row) each packed token belongs to; needs consistent counts."""
    q_lens = cu_seqlens_q.diff()
    return torch.repeat_interleave(torch.arange(len(q_lens)), q_lens, output_size=int(cu_seqlens_q[-1]))


def check_writes(slot_mapping: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
    """Raises RowsRefused, naming the sequences involved, if two new tokens write one pool slot (sequences
    sharing a block they write)."""
    slots, order = slot_mapping.sort()
    twice = slots[1:] == slots[:-1]
    if (i := _first(twice)) is not None:
        tokens = torch.cat([order[1:][twice], order[:-1][twice]])
        raise RowsRefused(
            f"slot {int(slots[i])} is written by two new tokens in one step: sequences writing in this step "
            "must not share blocks in block_tables (copy on write first)",
            row_of_token(cu_seqlens_q)[tokens].tolist(),
        )


def _first(bad: torch.Tensor) -> int | None:
    """Index of the first true entry of a 1-D mask, or None."""
    hits = bad.nonzero()
    return int(hits[0, 0]) if len(hits) else None


def _check_counts(sent: Sent) -> None:
    num_tokens, cu = len(sent.token_ids), sent.cu_seqlens_q
    if num_tokens == 0:
        raise InvalidArgument("empty step: token_ids is empty; send at least one sequence with one new token")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != num_tokens:
        raise InvalidArgument(
            f"cu_seqlens_q must run from 0 to the number of tokens ({num_tokens}), one offset per sequence "
            f"plus one; got {cu[:8].tolist()}{'...' if len(cu) > 8 else ''} ({len(cu)} offsets)"
        )
    if (seq := _first(cu.diff() < 1)) is not None:
        raise InvalidArgument(
            f"cu_seqlens_q is not increasing at sequence {seq} ({int(cu[seq])} -> {int(cu[seq + 1])}): "
            "every sequence needs at least one new token"
        )
    num_seqs = len(cu) - 1
    for field in ("num_computed", "sample"):
        if len(getattr(sent, field)) != num_seqs:
            raise InvalidArgument(
                f"{field} has {len(getattr(sent, field))} entries for {num_seqs} sequences in cu_seqlens_q"
            )
    for field in ("cached_prefix", "prompt_chunk", "sparse", "pool"):
        if len(getattr(sent, field)) not in (0, num_seqs):
            raise InvalidArgument(
                f"{field} has {len(getattr(sent, field))} entries for {num_seqs} sequences in cu_seqlens_q: "
                "send one per sequence, or none"
            )
    width, groups = sent.block_table_width, sent.num_kv_groups
    if width < 1 or len(sent.block_tables) != groups * num_seqs * width:
        of_groups = f"num_kv_groups ({groups}) * " if groups > 1 else ""
        raise InvalidArgument(
            f"block_tables has {len(sent.block_tables)} entries, expected {of_groups}num_seqs ({num_seqs}) * "
            f"block_table_width ({width}) with block_table_width >= 1"
        )
    if len(sent.sampling.seeds) != int(sent.sample.sum()):
        raise InvalidArgument(
            f"{len(sent.sampling.seeds)} sampling entries for {int(sent.sample.sum())} sequences with sample "
            "set: send one per sampling sequence, in order"
        )


def _rows(bad: torch.Tensor) -> list[int]:
    """The rows where a 1-D mask is true."""
    return bad.nonzero()[:, 0].tolist()


def _check_sequences(sent: Sent, context_lens: torch.Tensor, limits: Limits) -> None:
    tokens, num_computed = sent.token_ids, sent.num_computed
    outside = (tokens < 0) | (tokens >= limits.vocab_size)
    if (t := _first(outside)) is not None:
        raise RowsRefused(
            f"token_ids[{t}] = {int(tokens[t])} is outside the vocabulary [0, {limits.vocab_size})",
            row_of_token(sent.cu_seqlens_q)[outside].tolist(),
        )
    if (seq := _first(num_computed < 0)) is not None:
        raise RowsRefused(
            f"num_computed[{seq}] = {int(num_computed[seq])} is negative: it counts the sequence's tokens "
            "already in the KV cache before this step",
            _rows(num_computed < 0),
        )
    if (seq := _first(context_lens > limits.max_model_len)) is not None:
        raise RowsRefused(
            f"sequence {seq} reaches {int(context_lens[seq])} tokens (num_computed[{seq}] = "
            f"{int(num_computed[seq])} plus its new tokens), beyond the model's maximum length "
            f"{limits.max_model_len}",
            _rows(context_lens > limits.max_model_len),
        )


def _check_blocks(sent: Sent, context_lens: torch.Tensor, limits: Limits) -> None:
    width = sent.block_table_width
    needed_blocks = paging.blocks_for(context_lens, limits.block_size)
    if (seq := _first(needed_blocks > width)) is not None:
        raise RowsRefused(
            f"sequence {seq} needs {int(needed_blocks[seq])} blocks for {int(context_lens[seq])} tokens "
            f"(block size {limits.block_size}) but block_table_width is {width}",
            _rows(needed_blocks > width),
        )
    tables = sent.block_tables.view(sent.num_kv_groups, -1, width)
    outside = (tables < 0) | (tables >= limits.num_blocks)
    bad = outside & (torch.arange(width) < needed_blocks[:, None])
    if (entry := _first(bad.flatten())) is not None:
        group, at = divmod(entry, bad[0].numel())
        seq, col = divmod(at, width)
        named = f"group {group}'s " if sent.num_kv_groups > 1 else ""
        raise RowsRefused(
            f"{named}block_tables[{seq}][{col}] = {int(tables[group, seq, col])} is outside the pool (block "
            f"ids 0 .. {limits.num_blocks - 1}), and sequence {seq} needs its first "
            f"{int(needed_blocks[seq])} blocks for {int(context_lens[seq])} tokens: use the tables the cache "
            "service returned for this pool",
            _rows(bad.any(dim=2).any(dim=0)),
        )


def _check_sparse(rows: torch.Tensor, mode: SparseMode | None) -> None:
    """RowsRefused for rows asking for block-sparse decode (topk >= 1) where compute does not enable it, or
    with settings that cannot run."""
    sink, recent, topk = rows.unbind(1)
    if mode is None and (topk > 0).any():
        raise RowsRefused(
            "these rows ask for block-sparse decode (ForwardRequest.sparse topk >= 1) but compute runs "
            "without it: start compute with --sparse-attention allow (attention backend cpu-native), or "
            "send topk 0",
            _rows(topk > 0),
        )
    bad = (sink < 0) | (recent < 0) | (topk < 0) | ((topk > 0) & (recent < 1))
    if (seq := _first(bad)) is not None:
        raise RowsRefused(
            f"sparse[{seq}] = sink {int(sink[seq])}, recent {int(recent[seq])}, topk {int(topk[seq])}: sink "
            "must be >= 0, topk >= 0 (0: dense) and recent >= 1 where topk is not 0",
            _rows(bad),
        )


def _check_pool(sent: Sent, mode: str) -> None:
    """RowsRefused for pooling rows where the model does not pool, that also sample, or that pool the first
    token (cls) of a chunk that does not start the sequence."""
    if not len(sent.pool):
        return
    if not mode and sent.pool.any():
        raise RowsRefused(
            "these rows ask for pooling (ForwardRequest.pool) but the model does not pool: start compute "
            "with --pooling last, mean or cls, or serve a model that declares its pooling",
            _rows(sent.pool),
        )
    if (seq := _first(sent.pool & sent.sample)) is not None:
        raise RowsRefused(
            f"sequence {seq} both pools and samples: a pooling row returns its pooled hidden states only",
            _rows(sent.pool & sent.sample),
        )
    bad = sent.pool & (sent.num_computed > 0) if mode == "cls" else torch.zeros_like(sent.pool)
    if (seq := _first(bad)) is not None:
        raise RowsRefused(
            f"sequence {seq} pools its first token (cls pooling) but its chunk starts at token "
            f"{int(sent.num_computed[seq])}: send the chunk that starts the sequence",
            _rows(bad),
        )
