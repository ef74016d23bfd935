"""Block-sparse decode attention (--sparse-attention): a decode attends only to some blocks of its table.

Which blocks: the first `sink` blocks (attention sinks), the last `recent` blocks (the block being written
among them) and the `topk` blocks between them whose keys may score highest, by a per-block key summary
(Quest-style): each full block keeps the element-wise minimum and maximum of its keys per KV head
(compute_service.attention.block_summaries), and for a query q, sum over d of max(q_d * min_d, q_d * max_d)
bounds q . k from above for every key k of the block. The layer's query heads choose together (one table
per sequence and layer): a block's score is log sum over the heads of exp(scale * (its bound - the head's
best bound among the candidates)), the most attention the heads may give it, each relative to its best
block.

The chosen blocks, in table order, are the sequence's table for the kernel: its last block stays last, so
the kernel's causal mask over a compacted context of (blocks - 1) * block_size + the last block's tokens
lets the query see every key of every chosen block. A decode whose table holds no more blocks than
sink + recent + topk attends densely, as do prompts and chunks however short (prefill stays dense: the
gateway marks a one-token chunk of a prompt, ForwardRequest.prompt_chunk) and layers with a sliding window.
"""

from dataclasses import dataclass

import torch

from compute_service.attention.block_summaries import BlockSummaries
from compute_service.attention.sparse_settings import SparseAttention


@dataclass(frozen=True, slots=True)
class Selecting:
    """A step's decodes that attend sparsely, derived once for every layer: their rows, the table positions
    of their candidate blocks [R, C] (past each row's own candidates: position 0, masked out) and the
    block ids there."""

    rows: torch.Tensor  # [R]
    positions: torch.Tensor  # [R, C]
    blocks: torch.Tensor  # [R, C]
    valid: torch.Tensor  # [R, C] bool
    num_blocks: torch.Tensor  # [R] blocks of each row's context


def selecting(
    sparse: SparseAttention,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    prompt_chunks: torch.Tensor | None = None,
) -> Selecting | None:
    """The step's sparse decodes (one new token that is not a prompt's, `prompt_chunks` [N] bool; more
    blocks than the budget), or None when there are none."""
    num_blocks = (context_lens + block_size - 1) // block_size
    decodes = (q_lens == 1) & (num_blocks > sparse.budget)
    if prompt_chunks is not None:
        decodes &= ~prompt_chunks
    rows = decodes.nonzero().squeeze(1)
    if not len(rows):
        return None
    num_blocks = num_blocks[rows]
    counts = num_blocks - sparse.sink - sparse.recent
    offsets = torch.arange(int(counts.max()))
    valid = offsets[None, :] < counts[:, None]
    positions = torch.where(valid, sparse.sink + offsets[None, :], 0)
    return Selecting(rows, positions, block_tables[rows].gather(1, positions), valid, num_blocks)


def chosen_positions(
    sparse: SparseAttention,
    query: torch.Tensor,
    scale: float,
    lows: torch.Tensor,
    highs: torch.Tensor,
    sel: Selecting,
) -> torch.Tensor:
    """Table positions [R, budget], ascending, each selecting row attends to; query [R, H, D] (its decode
    token) whose scores are q . k * scale, lows/highs [R, C, Hkv, D] the candidates' key minima and
    maxima."""
    rows, candidates, kv_heads, head_dim = lows.shape
    q = query.float().view(rows, kv_heads, -1, head_dim)
    # the bound of head h on block c: q+ . max + q- . min
    bounds = torch.einsum("rkgd,rckd->rckg", q.clamp(min=0), highs)
    bounds += torch.einsum("rkgd,rckd->rckg", q.clamp(max=0), lows)
    bounds.masked_fill_(~sel.valid[:, :, None, None], float("-inf"))
    scores = ((bounds - bounds.amax(1, keepdim=True)) * scale).flatten(2).logsumexp(2)
    top = scores.topk(sparse.topk, dim=1).indices.sort(1).values
    recent = sel.num_blocks[:, None] - sparse.recent + torch.arange(sparse.recent)
    sink = torch.arange(sparse.sink).expand(rows, -1)
    return torch.cat((sink, sel.positions.gather(1, top), recent), dim=1)


def compact(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sel: Selecting,
    positions: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's tables and context lengths with each selecting row's chosen blocks only, in table order;
    the other rows' as they are."""
    tables, lens = block_tables.clone(), context_lens.clone()
    chosen = block_tables[sel.rows].gather(1, positions)
    tables[sel.rows] = -1
    tables[sel.rows, : chosen.shape[1]] = chosen
    last = context_lens[sel.rows] - (sel.num_blocks - 1) * block_size
    lens[sel.rows] = (chosen.shape[1] - 1) * block_size + last
    return tables, lens


@dataclass(slots=True)
class SparseDecode:
    """Block-sparse decode for one step: the config, the pool's block summaries, and what the step's first
    sparse layer derived (None until then)."""

    sparse: SparseAttention
    summaries: BlockSummaries
    # [N] bool: the rows whose one new token is a prompt's (the last after a prefix hit, say): dense
    prompt_chunks: torch.Tensor | None = None
    derived: Selecting | None = None
    ready: bool = False

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
        summaries = self.summaries
        if not self.ready:
            self.ready = True
            self.derived = selecting(
                self.sparse, q_lens, context_lens, block_tables, summaries.block_size, self.prompt_chunks
            )
            if self.derived is not None:
                summaries.refresh(self.derived.blocks[self.derived.valid])
        sel = self.derived
        if sel is None:
            return block_tables, context_lens
        lows, highs = summaries.of(layer, sel.blocks)
        positions = chosen_positions(self.sparse, query[q_starts[sel.rows]], scale, lows, highs, sel)
        return compact(block_tables, context_lens, sel, positions, summaries.block_size)
