"""Block-sparse decode attention (--sparse-attention; per row, ForwardRequest.sparse): a decode attends only
to some blocks of its table.

Which blocks: the first `sink` blocks (attention sinks), the last `recent` blocks (the block being written
among them) and the `topk` blocks between them whose keys may score highest, by a per-block key summary
(Quest-style): each full block keeps the element-wise minimum and maximum of its keys per KV head
(compute_service.attention.block_summaries), and for a query q, sum over d of max(q_d * min_d, q_d * max_d)
bounds q . k from above for every key k of the block. The layer's query heads choose together (one table
per sequence and layer): a block's score is log sum over the heads of exp(scale * (its bound - the head's
best bound among the candidates)), the most attention the heads may give it, each relative to its best
block. The native kernel chooses (compute_service/kernels/sparse_select.cpp, in a Python layer's attention
call or inside the native decode stack); compute_service.attention.reference.sparse_blocks is its pure-torch
reference.

The chosen blocks, in table order, are the sequence's table for the kernel: its last block stays last, so
the kernel's causal mask over a compacted context of (blocks - 1) * block_size + the last block's tokens
lets the query see every key of every chosen block. Each row has its own settings (or none: dense); a decode
whose table holds no more blocks than its sink + recent + topk attends densely, as do prompts and chunks
however short (prefill stays dense: the gateway marks a one-token chunk of a prompt,
ForwardRequest.prompt_chunk) and layers with a sliding window.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.sparse_settings import SparseAttention
from compute_service import kernels
from compute_service.attention.block_summaries import BlockSummaries


@dataclass(frozen=True, slots=True)
class Selecting:
    """A step's rows that attend sparsely, derived once for every layer: each row's settings [N, 3] (sink,
    recent, topk; topk 0: dense), and how many rows select."""

    settings: torch.Tensor
    rows: int


def selecting(
    rows: list[SparseAttention | None],
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: Sequence[torch.Tensor],
    summaries: BlockSummaries,
    prompt_chunks: torch.Tensor | None = None,
) -> Selecting | None:
    """The step's sparse decodes (one new token that is not a prompt's, `prompt_chunks` [N] bool; more
    blocks than the row's budget), or None when there are none; the summaries of their candidate blocks
    (between sink and recent) in each of `block_tables` (the tables of every KV group a sparse layer reads,
    all of one width) rebuilt where not current."""
    settings = torch.tensor([(s.sink, s.recent, s.topk) if s else (0, 1, 0) for s in rows], dtype=torch.int64)
    num_blocks = (context_lens + summaries.block_size - 1) // summaries.block_size
    decodes = (q_lens == 1) & (settings[:, 2] > 0) & (num_blocks > settings.sum(1))
    if prompt_chunks is not None:
        decodes &= ~prompt_chunks
    if not decodes.any():
        return None
    settings[~decodes, 2] = 0
    starts, ends = settings[:, 0], num_blocks - settings[:, 1]
    positions = torch.arange(block_tables[0].shape[1])
    candidates = decodes[:, None] & (positions >= starts[:, None]) & (positions < ends[:, None])
    summaries.refresh(torch.cat([tables[candidates] for tables in block_tables]))
    return Selecting(settings, int(decodes.sum()))


@dataclass(slots=True)
class SparseDecode:
    """Block-sparse decode for one step: each row's settings (None: dense), the pool's block summaries, and
    what the step derived for every layer (None until then)."""

    rows: list[SparseAttention | None]
    summaries: BlockSummaries
    # [N] bool: the rows whose one new token is a prompt's (the last after a prefix hit, say): dense
    prompt_chunks: torch.Tensor | None = None
    # On a pool of several KV groups: the tables of each group a sparse (full-attention) layer reads, whose
    # candidates' summaries the step rebuilds; empty: the tables the first selecting layer attends through.
    group_tables: tuple[torch.Tensor, ...] = ()
    derived: Selecting | None = None
    ready: bool = False

    def selection(
        self, q_lens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor
    ) -> Selecting | None:
        """The step's selecting rows, derived (and their candidates' summaries made current) once."""
        if not self.ready:
            self.ready = True
            tables = self.group_tables or (block_tables,)
            self.derived = selecting(
                self.rows, q_lens, context_lens, tables, self.summaries, self.prompt_chunks
            )
        return self.derived

    def tables(
        self,
        layer: int,
        query: torch.Tensor,
        scale: float,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block tables and context lengths layer `layer` attends through (query [T, H, D], scores
        q . k * scale): the step's own where no decode selects."""
        sel = self.selection(q_lens, context_lens, block_tables)
        if sel is None:
            return block_tables, context_lens
        return kernels.load().sparse_tables(
            query,
            self.summaries.of_layer(layer),
            block_tables,
            q_starts,
            context_lens,
            sel.settings,
            self.summaries.block_size,
            scale,
        )
