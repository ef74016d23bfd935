"""Multi-step decode (Compute.ForwardSteps): the first step's limits checked up front, and each following
step's request derived from the one before and the tokens it sampled, so that compute runs several decode
steps per call without a round trip to the gateway between them."""

from dataclasses import dataclass

import torch

from common.errors import InvalidArgument
from common.paging import MAX_DECODE_STEPS as MAX_STEPS
from compute_service.validation import Limits, Sent, check_reach
from protos import compute_pb2


@dataclass(slots=True)
class StepsPlan:
    """Which rows of the first step still run (`rows`, in order), how many steps each has run, and when each
    stops: after max_steps steps, or after sampling one of its stop ids."""

    max_steps: list[int]
    stop_ids: list[frozenset[int]]
    rows: list[int]
    taken: list[int]

    @classmethod
    def check(cls, request: compute_pb2.StepsRequest, limits: Limits) -> "StepsPlan":
        """The plan of a request whose first step is already checked as a Forward; raises InvalidArgument
        (RowsRefused naming rows) unless every row decodes one token, samples, and has the slots, the
        model length and the pool for all its steps."""
        first, n = request.first, len(request.first.cu_seqlens_q) - 1
        if list(first.cu_seqlens_q) != list(range(n + 1)) or not all(first.sample):
            raise InvalidArgument(
                "ForwardSteps runs decodes only: every row of its first step has one new token and samples "
                "(send prompt chunks with Forward)"
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

    def advance(
        self, request: compute_pb2.ForwardRequest, tokens: list[int]
    ) -> compute_pb2.ForwardRequest | None:
        """Counts the step `request` ran, which sampled `tokens` (one per running row); returns the next
        step's request for the rows that go on, or None when none does."""
        keep = []
        for i, (row, token) in enumerate(zip(self.rows, tokens, strict=True)):
            self.taken[row] += 1
            if self.taken[row] < self.max_steps[row] and token not in self.stop_ids[row]:
                keep.append(i)
        self.rows = [self.rows[i] for i in keep]
        return next_request(request, tokens, keep) if keep else None


def next_request(
    request: compute_pb2.ForwardRequest, tokens: list[int], keep: list[int]
) -> compute_pb2.ForwardRequest:
    """The decode step after `request` (one new token per row, every row sampling) for its rows `keep`:
    each feeds the token it sampled, one position on; a penalized row's history gains that token and the
    generated counts grow by one."""
    width, tables = request.block_table_width, request.block_tables
    following = compute_pb2.ForwardRequest(
        pool_epoch=request.pool_epoch,
        token_ids=[tokens[i] for i in keep],
        cu_seqlens_q=range(len(keep) + 1),
        num_computed=[request.num_computed[i] + 1 for i in keep],
        block_tables=[b for i in keep for b in tables[i * width : (i + 1) * width]],
        block_table_width=width,
        sample=[True] * len(keep),
        sampling=[request.sampling[i] for i in keep],
    )
    if request.cu_history:
        cu, history = request.cu_history, request.history_token_ids
        rows = [
            [*history[cu[i] : cu[i + 1]], *([tokens[i]] if penalized(request.sampling[i]) else [])]
            for i in keep
        ]
        following.history_token_ids.extend(t for row in rows for t in row)
        following.cu_history.extend([0])
        for row in rows:
            following.cu_history.append(following.cu_history[-1] + len(row))
        following.history_prompt_lens.extend(request.history_prompt_lens[i] for i in keep)
    if request.output_lens:
        following.output_lens.extend(request.output_lens[i] + 1 for i in keep)
    return following


def penalized(row: compute_pb2.RowSampling) -> bool:
    """Whether a penalty looks at the row's generated tokens (the gateway then sends them as history)."""
    repetition = row.HasField("repetition_penalty") and row.repetition_penalty != 1
    return repetition or row.presence_penalty != 0 or row.frequency_penalty != 0
