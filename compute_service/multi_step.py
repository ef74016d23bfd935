"""A multi-step (Compute.ForwardSteps: several decode steps in one call): the first step's limits checked up
front, and each following step derived from the one before and the tokens it sampled
(ForwardBatch.following), so that compute runs several decode steps per call without a round trip to the
gateway between them."""

from dataclasses import dataclass

import torch

from common.errors import InvalidArgument
from common.paging import MAX_DECODE_STEPS as MAX_STEPS
from common.paging import MAX_DRAFT_TOKENS
from compute_service.speculation import Lookup
from compute_service.validation import Limits, Sent, check_reach
from protos import compute_pb2


@dataclass(slots=True)
class MultiStepPlan:
    """Which rows of the first step still run (`rows`, in order), how many tokens each has taken, and when
    each stops: after max_steps tokens, or after taking one of its stop ids; and the rows' lookup tokens
    when they draft (compute_service.speculation)."""

    max_steps: list[int]
    stop_ids: list[frozenset[int]]
    rows: list[int]
    taken: list[int]
    lookup: Lookup | None = None

    @classmethod
    def check(cls, request: compute_pb2.StepsRequest, limits: Limits) -> "MultiStepPlan":
        """The plan of a request whose first step is already checked as a Forward; raises InvalidArgument
        (RowsRefused naming rows) unless every row decodes one token, samples, and has the slots, the
        model length and the pool for all its steps."""
        first, n = request.first, len(request.first.cu_seqlens_q) - 1
        if list(first.cu_seqlens_q) != list(range(n + 1)) or not all(first.sample):
            raise InvalidArgument(
                "ForwardSteps runs decodes only: every row of its first step has one new token and samples "
                "(send prompt chunks with Forward)"
            )
        if first.prompt_target_ids:
            raise InvalidArgument(
                "ForwardSteps scores no prompt tokens: its rows decode (send prompt targets with Forward)"
            )
        if first.constraint_rows:
            raise InvalidArgument(
                "ForwardSteps runs no constrained rows: their masks follow each sampled token (send them "
                "with Forward)"
            )
        max_steps = list(request.max_steps)
        if len(max_steps) != n or not all(1 <= m <= MAX_STEPS for m in max_steps):
            raise InvalidArgument(
                f"max_steps needs one value per row ({n}), each in [1, {MAX_STEPS}]; got {max_steps[:20]}"
            )
        cu = _offsets("stop_token_ids", request.cu_stop_token_ids, n, len(request.stop_token_ids))
        lookup = _lookup(request, n, limits)
        sent = Sent.from_request(first)
        # NOTE: a row's last step holds num_computed + max_steps tokens: its slots must be in its table now.
        check_reach(sent, sent.num_computed + torch.tensor(max_steps), limits)
        stops = request.stop_token_ids
        stop_ids = [frozenset(stops[cu[row] : cu[row + 1]]) for row in range(n)]
        return cls(max_steps, stop_ids, list(range(n)), [0] * n, lookup)

    def advance(self, tokens: list[int]) -> list[int]:
        """Counts the step its rows ran, which sampled `tokens` (one per running row); returns which of them
        (indices, ascending) go on to the next step, none when all are done."""
        keep = [
            i
            for i, (row, token) in enumerate(zip(self.rows, tokens, strict=True))
            if self.take(row, [token])[1]
        ]
        self.rows = [self.rows[i] for i in keep]
        return keep

    def take(self, row: int, tokens: list[int]) -> tuple[list[int], bool]:
        """The first of `tokens` (a step's, in order) that row `row` takes, up to its max_steps and its first
        stop id, and whether it runs on after them."""
        for count, token in enumerate(tokens, 1):
            self.taken[row] += 1
            if self.taken[row] >= self.max_steps[row] or token in self.stop_ids[row]:
                return tokens[:count], False
        return tokens, True

    def room(self, row: int) -> int:
        """Drafts row `row` may feed after its token: the fed tokens' slots stay within its max_steps."""
        return self.max_steps[row] - self.taken[row] - 1


def _offsets(name: str, cu, n: int, total: int) -> list[int]:
    """cu_`name`, checked: n + 1 ascending offsets from 0 to len(`name`) (`total`)."""
    cu = list(cu)
    if len(cu) != n + 1 or cu[0] != 0 or cu[-1] != total or cu != sorted(cu):
        raise InvalidArgument(
            f"cu_{name} needs {n + 1} ascending offsets from 0 to len({name}) ({total}); got {cu[:20]}"
        )
    return cu


def _lookup(request: compute_pb2.StepsRequest, n: int, limits: Limits) -> Lookup | None:
    """The rows' lookup tokens when the call drafts (draft_tokens > 0), checked."""
    draft, ids = request.draft_tokens, request.lookup_token_ids
    if not 0 <= draft <= MAX_DRAFT_TOKENS:
        raise InvalidArgument(f"draft_tokens must be in [0, {MAX_DRAFT_TOKENS}]; got {draft}")
    if not draft and not ids and not request.cu_lookup_token_ids:
        return None
    cu = _offsets("lookup_token_ids", request.cu_lookup_token_ids, n, len(ids))
    if ids and not (min(ids) >= 0 and max(ids) < limits.vocab_size):
        raise InvalidArgument(f"lookup_token_ids must be token ids in [0, {limits.vocab_size})")
    longest = max(b - a for a, b in zip(cu, cu[1:], strict=False))
    if longest > limits.max_model_len:
        raise InvalidArgument(
            f"a row's lookup_token_ids ({longest}) are longer than the model ({limits.max_model_len} tokens)"
        )
    return Lookup(list(ids), cu, draft) if draft else None
