"""Prompt log-probabilities (ForwardRequest.prompt_*): the prompt tokens a step scores, checked, and their
scores computed from the step's own hidden states, so that a prompt is scored in the forward that writes its
K/V."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.errors import InvalidArgument
from common.sampling_controls import MAX_LOGPROBS

# Positions whose logits are materialised at once ([chunk, vocab] float32: 64 MiB for a 64k vocabulary).
SCORE_CHUNK = 256


@dataclass(slots=True)
class PromptTargets:
    """The prompt tokens one step scores: for each, the packed new token whose logits predict it, its id,
    and how many top alternatives its row asked for."""

    positions: torch.Tensor  # [P] int64
    token_ids: torch.Tensor  # [P] int64
    top: torch.Tensor  # [P] int64

    @property
    def width(self) -> int:
        return int(self.top.max()) if len(self.top) else 0


@dataclass(slots=True)
class PromptScores:
    logprobs: torch.Tensor  # [P] float32
    ranks: torch.Tensor  # [P] int64, 1: the most likely token
    top_ids: torch.Tensor  # [P, width] int64, most likely first
    top_logprobs: torch.Tensor  # [P, width] float32


def targets(
    asked: torch.Tensor, target_ids: torch.Tensor, cu_targets: torch.Tensor, cu_seqlens_q: torch.Tensor,
    vocab_size: int,
) -> PromptTargets | None:  # fmt: skip
    """The step's targets, None when no row asks; raises InvalidArgument naming the field unless every row
    asking has at most one target per new token, inside the vocabulary. Needs consistent cu_seqlens_q."""
    num_seqs = len(cu_seqlens_q) - 1
    if len(asked) not in (0, num_seqs):
        raise InvalidArgument(
            f"prompt_logprobs has {len(asked)} entries for {num_seqs} sequences: send one per sequence, or "
            "none"
        )
    if len(asked) and not bool(((asked >= -1) & (asked <= MAX_LOGPROBS)).all()):
        raise InvalidArgument(f"prompt_logprobs entries must be in [-1, {MAX_LOGPROBS}] (-1: none)")
    rows = (asked >= 0).nonzero()[:, 0]
    if len(rows) == 0:
        if len(target_ids) or len(cu_targets):
            raise InvalidArgument("prompt_target_ids and cu_prompt_targets need rows with prompt_logprobs")
        return None
    if len(cu_targets) != len(rows) + 1 or cu_targets[0] != 0 or cu_targets[-1] != len(target_ids):
        raise InvalidArgument(
            f"cu_prompt_targets must run from 0 to len(prompt_target_ids) ({len(target_ids)}) with one "
            f"offset per row asking for prompt_logprobs ({len(rows)}) plus one"
        )
    counts = cu_targets.diff()
    new_tokens = cu_seqlens_q.diff()[rows]
    if bool(((counts < 0) | (counts > new_tokens)).any()):
        raise InvalidArgument(
            "cu_prompt_targets gives a row more prompt targets than new tokens, or fewer than none: at most "
            "one target per new token"
        )
    if len(target_ids) and bool(((target_ids < 0) | (target_ids >= vocab_size)).any()):
        raise InvalidArgument(f"prompt_target_ids has ids outside the vocabulary [0, {vocab_size})")
    # target j of a row is scored at its new token j
    row_of_target = torch.repeat_interleave(torch.arange(len(rows)), counts)
    within = torch.arange(len(target_ids)) - cu_targets[:-1][row_of_target]
    return PromptTargets(
        positions=cu_seqlens_q[:-1][rows][row_of_target] + within,
        token_ids=target_ids,
        top=asked[rows][row_of_target],
    )


def score(
    hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: PromptTargets
) -> PromptScores:
    """Each target's log-probability (log_softmax of the float32 logits `head` makes of its position's hidden
    state), rank and top alternatives, SCORE_CHUNK positions at a time."""
    width, parts = targets.width, []
    for start in range(0, len(targets.positions), SCORE_CHUNK):
        end = start + SCORE_CHUNK
        at = targets.positions[start:end].to(hidden.device)
        logprobs = head(hidden[at]).float().cpu().log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets.token_ids[start:end, None])
        # NOTE: as vLLM ranks: the tokens at least as likely, the token itself included.
        ranks = (logprobs >= chosen).sum(dim=1)
        top = logprobs.topk(width, dim=1)
        parts.append((chosen[:, 0], ranks, top.indices, top.values))
    if not parts:
        none = torch.zeros((0, width))
        return PromptScores(torch.zeros(0), torch.zeros(0, dtype=torch.long), none.long(), none)
    return PromptScores(*(torch.cat(columns) for columns in zip(*parts, strict=True)))


def reply_fields(scores: PromptScores | None) -> dict:
    """The ForwardResponse fields of a step's prompt scores (none: no row asked)."""
    if scores is None:
        return {}
    return {
        "prompt_logprobs": scores.logprobs.tolist(),
        "prompt_ranks": scores.ranks.tolist(),
        "prompt_top_width": scores.top_ids.shape[1],
        "prompt_top_token_ids": scores.top_ids.flatten().tolist(),
        "prompt_top_logprobs": scores.top_logprobs.flatten().tolist(),
    }
