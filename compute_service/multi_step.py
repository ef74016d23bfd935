"""A multi-step (Compute.ForwardSteps: several decode steps in one call): the first step's limits checked up
front, and each following step derived from the one before and the tokens it sampled
(ForwardBatch.following), so that compute runs several decode steps per call without a round trip to the
gateway between them."""

from dataclasses import dataclass

import torch

from common.errors import InvalidArgument
from common.paging import MAX_DECODE_STEPS as MAX_STEPS
from compute_service.validation import Limits, Sent, check_reach
from protos import compute_pb2


@dataclass(slots=True)
class MultiStepPlan:
    """Which rows of the first step still run (`rows`, in order), how many steps each has run, and when each
    stops: after max_steps steps, or after sampling one of its stop ids."""

    max_steps: list[int]
    stop_ids: list[frozenset[int]]
    rows: list[int]
    taken: list[int]

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
        cu = list(request.cu_stop_token_ids)
        if len(cu) != n + 1 or cu[0] != 0 or cu[-1] != len(request.stop_token_ids) or cu != sorted(cu):
            raise InvalidArgument(
                f"cu_stop_token_ids needs {n + 1} ascending offsets from 0 to len(stop_token_ids) "
                f"({len(request.stop_token_ids)}); got {cu[:20]}"
            )
        sent = Sent.from_request(first)
        # NOTE: a row's last step holds num_computed + max_steps tokens: its slots must be in its table now.
        check_reach(sent, sent.num_computed + torch.tensor(max_steps), limits)
        stops = request.stop_token_ids
        stop_ids = [frozenset(stops[cu[row] : cu[row + 1]]) for row in range(n)]
        return cls(max_steps, stop_ids, list(range(n)), [0] * n)

    def advance(self, tokens: list[int]) -> list[int]:
        """Counts the step its rows ran, which sampled `tokens` (one per running row); returns which of them
        (indices, ascending) go on to the next step, none when all are done."""
        keep = []
        for i, (row, token) in enumerate(zip(self.rows, tokens, strict=True)):
            self.taken[row] += 1
            if self.taken[row] < self.max_steps[row] and token not in self.stop_ids[row]:
                keep.append(i)
        self.rows = [self.rows[i] for i in keep]
        return keep
