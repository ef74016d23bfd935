"""Prompt lookup in ForwardSteps (StepsRequest.draft_tokens): each step, a row whose last tokens recur
earlier in its lookup tokens (its prompt and generated ones) feeds the tokens that followed them there as
drafts after its own token. The step's greedy choice after each fed token keeps the drafts it agrees with
and adds its own token after them, so one step can yield several tokens of a row for about the cost of one
where reading the weights dominates (decodes of few rows). Only plain greedy rows draft: their tokens are
the argmax whatever the drafts, which only propose."""

from dataclasses import replace

import numpy as np
import torch
from prometheus_client import Counter

from compute_service.batch import ForwardBatch
from compute_service.validation import Sent
from protos import compute_pb2

# The longest and shortest runs of a row's last tokens looked up, longest first.
LONGEST, SHORTEST = 3, 1

DRAFTED = Counter("pagedserve_draft_tokens", "Prompt-lookup drafts fed to ForwardSteps steps.")
ACCEPTED = Counter("pagedserve_draft_tokens_accepted", "Drafts the steps' greedy choices kept.")


class Lookup:
    """Each row's lookup tokens, grown by the tokens it keeps, and the drafts found in them."""

    def __init__(self, tokens: list[int], cu: list[int], draft_tokens: int) -> None:
        ids = np.asarray(tokens, dtype=np.int64)
        self.tokens = [ids[cu[row] : cu[row + 1]] for row in range(len(cu) - 1)]
        self.draft_tokens = draft_tokens

    def draft(self, row: int, room: int) -> list[int]:
        """Up to min(draft_tokens, room) ids that followed the latest earlier run of the row's last n tokens,
        for the longest n from LONGEST down to SHORTEST that recurs; none if none does."""
        ids, k = self.tokens[row], min(self.draft_tokens, room)
        end = len(ids)
        for n in range(min(LONGEST, end - 1), SHORTEST - 1, -1) if k > 0 else ():
            # starts s of earlier runs equal to ids[end - n:], each followed by at least one token
            starts = np.flatnonzero(ids[: end - n] == ids[end - n])
            for j in range(1, n):
                starts = starts[ids[starts + j] == ids[end - n + j]]
            if len(starts):
                after = int(starts[-1]) + n
                return ids[after : after + k].tolist()
        return []

    def extend(self, row: int, tokens: list[int]) -> None:
        self.tokens[row] = np.concatenate((self.tokens[row], np.asarray(tokens, dtype=np.int64)))


def step_batch(
    first: ForwardBatch, rows: list[int], feeds: list[list[int]], starts: list[int], block_size: int
) -> ForwardBatch:
    """The step in which row rows[i] of the call's first step (ascending) feeds feeds[i] from position
    starts[i] on, with the logits of every token; rows of one token each make the all-decode step
    ForwardBatch.following does. Unchecked, as that one: the call's plan verified up front that every row's
    slots for all its steps lie in its table (the feeds never go past them: see MultiStepPlan.room).

    NOTE: the rows' sampling and LoRA adapters are the first step's, as `following` carries them on; a plain
    greedy row reads none of its sampling."""
    picked = torch.tensor(rows)
    groups = first.group_tables or (first.block_tables,)
    lengths = torch.tensor([len(feed) for feed in feeds])
    sent = Sent(
        token_ids=torch.tensor([token for feed in feeds for token in feed]),
        cu_seqlens_q=torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))),
        num_computed=torch.tensor(starts),
        block_tables=torch.stack([tables[picked] for tables in groups]).flatten(),
        block_table_width=groups[0].shape[1],
        num_kv_groups=len(groups),
        sample=torch.ones(len(rows), dtype=torch.bool),
        sampling=first.sampling.following(first.token_ids, picked),
        cached_prefix=torch.zeros(0, dtype=torch.bool),
        prompt_chunk=torch.zeros(0, dtype=torch.bool),
        sparse=torch.zeros((0, 3), dtype=torch.int64),
    )
    lora_ids = None if first.lora_ids is None else first.lora_ids[picked]
    return replace(ForwardBatch.derive(sent, block_size), logit_tokens=None, lora_ids=lora_ids)


def verified(feeds: list[list[int]], chosen: list[int]) -> list[list[int]]:
    """Per row, the tokens its step yields (`chosen`: the greedy choice after each fed token, packed as
    the feeds): the choices after its own token and after each draft that agreed with the choice before."""
    out, at = [], 0
    for feed in feeds:
        mine = chosen[at : at + len(feed)]
        kept = 1
        while kept < len(feed) and feed[kept] == mine[kept - 1]:
            kept += 1
        out.append(mine[:kept])
        at += len(feed)
    return out


def replies_by_depth(
    reply: compute_pb2.ForwardResponse,
    rows: list[int],
    feeds: list[list[int]],
    kept: list[list[int]],
    going: set[int],
) -> list[compute_pb2.ForwardResponse]:
    """The step's replies, one token per row each: the j-th holds the j-th kept token of every row that kept
    more than j, and the first carries the step's times and draft counts (also counted in DRAFTED and
    ACCEPTED), the later ones same_step. A row runs on after a reply while it has a later one, or after its
    last if it is `going` on to the next step."""
    offsets = np.cumsum([0] + [len(feed) for feed in feeds])
    first = compute_pb2.ForwardResponse()
    first.CopyFrom(reply)
    del first.token_ids[:], first.logprobs[:]
    first.drafted_tokens = int(offsets[-1]) - len(feeds)
    first.accepted_tokens = sum(len(tokens) - 1 for tokens in kept)
    DRAFTED.inc(first.drafted_tokens)
    ACCEPTED.inc(first.accepted_tokens)
    parts = [first] + [compute_pb2.ForwardResponse(same_step=True) for _ in range(max(map(len, kept)) - 1)]
    for row, at, tokens in zip(rows, offsets[:-1], kept, strict=True):
        for depth, token in enumerate(tokens):
            parts[depth].rows.append(row)
            parts[depth].token_ids.append(token)
            parts[depth].logprobs.append(reply.logprobs[at + depth])
            parts[depth].running.append(depth + 1 < len(tokens) or row in going)
    return parts
