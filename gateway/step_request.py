"""What a scheduled step sends compute: the Forward request (what only the gateway knows: the new tokens, how
many tokens each sequence already has in the KV cache, the block tables, sampling; compute derives positions
and slots), and for a multi-step the ForwardSteps call's first message, with each row's limit and its lookup
tokens for drafting."""

from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from gateway.sampling import forward_sampling
from gateway.sequence import Sampling, Sequence
from gateway.vision import forward_images
from protos import compute_pb2


@dataclass(frozen=True, slots=True)
class RowLimit:
    """Where compute stops a row: after `max_steps` steps, or after sampling one of `stop_ids` (each reply
    says which rows it runs on: ForwardResponse.running)."""

    max_steps: int
    stop_ids: frozenset[int]


def forward_request(
    seqs: list[Sequence],
    tables: list[list[list[int]]],
    epoch: str,
    eos_ids: frozenset[int],
    session_epoch: int = 0,
) -> compute_pb2.ForwardRequest:
    """The step's chunks [num_computed, chunk_end) of `seqs`, whose block tables in KV group g are
    `tables[g]`, packed, on the pool of `epoch`, for the session opened with `session_epoch` (0: none)."""
    width = max(len(table) for group in tables for table in group)
    rows = np.full((len(tables), len(seqs), width), -1, dtype=np.int64)
    for group_rows, group in zip(rows, tables, strict=True):
        for row, table in zip(group_rows, group, strict=True):
            row[: len(table)] = table
    return compute_pb2.ForwardRequest(
        pool_epoch=epoch,
        session_epoch=session_epoch,
        token_ids=[t for seq in seqs for t in seq.token_ids[seq.num_computed : seq.chunk_end]],
        cu_seqlens_q=list(accumulate((seq.chunk_len for seq in seqs), initial=0)),
        num_computed=[seq.num_computed for seq in seqs],
        block_tables=rows.ravel().tolist(),
        block_table_width=width,
        num_kv_groups=len(tables) if len(tables) > 1 else 0,
        sample=[seq.samples_now for seq in seqs],
        cached_prefix=_flags([seq.cached_prefix for seq in seqs]),
        prompt_chunk=_flags([seq.chunk_end <= len(seq.prompt_ids) for seq in seqs]),
        sparse=_sparse_rows(seqs),
        pool=_flags([seq.pools_now for seq in seqs]),
        lora_ids=[seq.lora_id for seq in seqs] if any(seq.lora_id for seq in seqs) else [],
        **forward_sampling([seq for seq in seqs if seq.samples_now], eos_ids),
        **_prompt_targets(seqs),
        images=forward_images(seqs),
    )


def _prompt_targets(seqs: list[Sequence]) -> dict:
    """The ForwardRequest fields of the rows that score their prompt (none when no row does): each new
    token's next prompt token is its target, so a prompt's last token (which samples) has none."""
    scoring = [seq for seq in seqs if seq.scores_prompt]
    if not scoring:
        return {}
    targets = [seq.prompt_ids[seq.num_computed + 1 : seq.chunk_end + 1] for seq in scoring]
    return {
        "prompt_logprobs": [seq.sampling.prompt_logprobs if seq.scores_prompt else -1 for seq in seqs],
        "prompt_target_ids": [t for row in targets for t in row],
        "cu_prompt_targets": list(accumulate((len(row) for row in targets), initial=0)),
    }


def _flags(flags: list[bool]) -> list[bool]:
    """A per-sequence flag as sent: none when no sequence sets it."""
    return flags if any(flags) else []


def _sparse_rows(seqs: list[Sequence]) -> list[compute_pb2.SparseRow]:
    """Each sequence's block-sparse settings as sent: none where compute has no block-sparse decode."""
    if all(seq.sparse is None for seq in seqs):
        return []
    rows = [seq.sparse or (0, 0, 0) for seq in seqs]
    return [compute_pb2.SparseRow(sink=sink, recent=recent, topk=topk) for sink, recent, topk in rows]


def row_limit(seq: Sequence, steps: int, eos_ids: frozenset[int]) -> RowLimit:
    """A row goes at most `steps` steps and never past its max_tokens or the longest sequence; it stops on
    the ids that end it (EOS unless ignore_eos) once min_tokens is reached (before, they are suppressed)."""
    s = seq.sampling
    stop_ids = s.stop_token_ids if s.ignore_eos else s.stop_token_ids | eos_ids
    return RowLimit(seq.lookahead(steps) + 1, frozenset(stop_ids))


def multi_step_request(
    seqs: list[Sequence],
    tables: list[list[list[int]]],
    epoch: str,
    eos_ids: frozenset[int],
    limits: list[RowLimit],
    session_epoch: int = 0,
) -> compute_pb2.StepsRequest:
    """The call's first message: the step as a Forward would send it, and each row's limit."""
    request = compute_pb2.StepsRequest(
        first=forward_request(seqs, tables, epoch, eos_ids, session_epoch),
        max_steps=[limit.max_steps for limit in limits],
        cu_stop_token_ids=[0],
    )
    for limit in limits:
        request.stop_token_ids.extend(sorted(limit.stop_ids))
        request.cu_stop_token_ids.append(len(request.stop_token_ids))
    return request


def with_lookup(request: compute_pb2.StepsRequest, seqs: list[Sequence], draft_tokens: int) -> None:
    """Each row's tokens so far as its lookup tokens, when the call may draft: draft_tokens > 0 and every row
    plain greedy (compute checks that itself, min_tokens included: it drafts only for plain greedy rows)."""
    if not draft_tokens or not all(_plain_greedy(seq.sampling) for seq in seqs):
        return
    request.draft_tokens = draft_tokens
    request.cu_lookup_token_ids.append(0)
    for seq in seqs:
        request.lookup_token_ids.extend(seq.prompt_ids)
        request.lookup_token_ids.extend(seq.output_ids)
        request.cu_lookup_token_ids.append(len(request.lookup_token_ids))


def _plain_greedy(s: Sampling) -> bool:
    return s.temperature == 0 and s.logprobs is None and not s.penalized and not s.logit_bias
