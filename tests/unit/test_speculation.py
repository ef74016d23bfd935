"""Prompt lookup (compute_service/speculation.py): which drafts a row's lookup tokens give, which of them a
step keeps, how a step's kept tokens become replies of one token per row, and how a row takes them up to its
limits (compute_service/multi_step.py); the gateway sends lookup tokens only for calls of greedy rows."""

import re
from dataclasses import replace

import pytest
import torch

from common.errors import InvalidArgument
from compute_service.batch import ForwardBatch
from compute_service.multi_step import MultiStepPlan
from compute_service.speculation import Lookup, replies_by_depth, step_batch, verified
from compute_service.validation import Limits
from gateway.sequence import Sampling, Sequence
from gateway.step_request import multi_step_request, with_lookup
from protos import compute_pb2
from tests.forward import forward_request


def _lookup(*rows: list[int], draft_tokens: int = 4) -> Lookup:
    cu = [0]
    for row in rows:
        cu.append(cu[-1] + len(row))
    return Lookup([t for row in rows for t in row], cu, draft_tokens)


def test_the_longest_recurring_run_of_the_last_tokens_gives_the_draft():
    # the last 3 tokens (7 8 9) recur once, followed by 1 2; the last one alone (9) recurs later, before 5
    lookup = _lookup([7, 8, 9, 1, 2, 3, 9, 5, 7, 8, 9])
    assert lookup.draft(0, room=10) == [1, 2, 3, 9]


def test_the_latest_run_is_taken_and_the_draft_is_cut_to_the_room():
    lookup = _lookup([4, 1, 4, 2, 3, 4])
    assert lookup.draft(0, room=10) == [2, 3, 4]
    assert lookup.draft(0, room=1) == [2]
    assert lookup.draft(0, room=0) == []


def test_no_recurrence_no_draft_and_kept_tokens_extend_the_lookup():
    lookup = _lookup([1, 2, 3], [], [6])
    assert lookup.draft(0, 10) == [] and lookup.draft(1, 10) == [] and lookup.draft(2, 10) == []
    lookup.extend(0, [1])
    assert lookup.draft(0, 10) == [2, 3, 1]


def test_a_step_keeps_the_drafts_up_to_the_first_disagreement_and_the_choice_after():
    feeds = [[10, 11, 12, 13], [20], [30, 31, 32]]
    # row 0: choices after 10, 11 agree with the drafts 11 12; after 12 it chose 99, not 13
    chosen = [11, 12, 99, 14, 21, 40, 41, 42]
    assert verified(feeds, chosen) == [[11, 12, 99], [21], [40]]


def test_replies_hold_one_token_per_row_by_depth():
    reply = compute_pb2.ForwardResponse(
        token_ids=[11, 12, 99, 14, 21, 40], logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5, -0.6], forward_ms=7.0
    )
    feeds = [[10, 11, 12, 13], [20], [30]]
    parts = replies_by_depth(reply, [0, 2, 5], feeds, [[11, 12, 99], [21], [40]], going={0, 5})
    assert [(list(p.rows), list(p.token_ids), p.same_step) for p in parts] == [
        ([0, 2, 5], [11, 21, 40], False),
        ([0], [12], True),
        ([0], [99], True),
    ]
    assert [list(p.running) for p in parts] == [[True, False, True], [True], [True]], (
        "a row runs on after each reply but its last, and after its last if it goes on"
    )
    assert [logprob for p in parts for logprob in p.logprobs] == pytest.approx([-0.1, -0.5, -0.6, -0.2, -0.3])
    assert (parts[0].forward_ms, parts[0].drafted_tokens, parts[0].accepted_tokens) == (7.0, 3, 2)
    assert parts[1].forward_ms == 0


LIMITS = Limits(vocab_size=100, max_model_len=64, num_blocks=16, block_size=4)


def _whole_tables(request: compute_pb2.ForwardRequest) -> compute_pb2.ForwardRequest:
    """Row i's table [2i, 2i + 1], both blocks (slots for 8 tokens) however few its step needs."""
    rows = len(request.num_computed)
    request.block_table_width = 2
    request.block_tables[:] = range(2 * rows)
    return request


def _steps(max_steps: list[int], **fields) -> compute_pb2.StepsRequest:
    n = len(max_steps)
    first = _whole_tables(forward_request([[1]] * n, [3] * n, [[0]] * n, block_size=4))
    fields = {"cu_stop_token_ids": [0] * (n + 1), **fields}
    request = compute_pb2.StepsRequest(first=first, max_steps=max_steps)
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
    return request


def test_a_row_takes_drafts_up_to_its_max_steps_and_stop_ids():
    lookup = {"draft_tokens": 2, "lookup_token_ids": [1, 1], "cu_lookup_token_ids": [0, 1, 2]}
    request = _steps([4, 4], stop_token_ids=[7], cu_stop_token_ids=[0, 0, 1], **lookup)
    plan = MultiStepPlan.check(request, LIMITS)
    assert plan.room(0) == 3
    assert plan.take(0, [5, 6, 8]) == ([5, 6, 8], True) and plan.room(0) == 0
    assert plan.take(0, [9, 9]) == ([9], False)
    assert plan.take(1, [3, 7, 5]) == ([3, 7], False)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"draft_tokens": 17, "cu_lookup_token_ids": [0, 0]}, "draft_tokens must be in [0, 16]"),
        ({"draft_tokens": 2}, "cu_lookup_token_ids needs 2 ascending offsets"),
        ({"draft_tokens": 2, "lookup_token_ids": [1], "cu_lookup_token_ids": [0, 2]}, "cu_lookup_token_ids"),
        (
            {"draft_tokens": 2, "lookup_token_ids": [-1], "cu_lookup_token_ids": [0, 1]},
            "token ids in [0, 100)",
        ),
        (
            {"draft_tokens": 2, "lookup_token_ids": [1] * 65, "cu_lookup_token_ids": [0, 65]},
            "longer than the model",
        ),
    ],
)
def test_bad_lookup_fields_are_refused(fields, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        MultiStepPlan.check(_steps([4], **fields), LIMITS)


def test_a_step_batch_of_one_token_rows_is_the_following_decode_step():
    request = _whole_tables(forward_request([[5], [6], [7]], [3, 6, 2], [[0]] * 3, block_size=4))
    first = ForwardBatch.from_request(request, LIMITS)
    following = first.following(torch.tensor([8, 9, 10]), [0, 2], 4)
    built = step_batch(first, [0, 2], [[8], [10]], [4, 3], 4)
    for name in ("token_ids", "positions", "slot_mapping", "cu_seqlens_q", "context_lens", "block_tables"):
        assert torch.equal(getattr(built, name), getattr(following, name)), name
    assert (built.logit_tokens, built.prompt_rows) == (None, [])
    drafted = step_batch(first, [0, 2], [[8, 1, 2], [10]], [4, 3], 4)
    assert drafted.positions.tolist() == [4, 5, 6, 3] and drafted.context_lens.tolist() == [7, 4]
    assert drafted.slot_mapping.tolist() == [4, 5, 6, 19] and drafted.logit_tokens is None


def _seq(**sampling) -> Sequence:
    seq = Sequence("s", [1, 2, 3], replace(Sampling(), **{"temperature": 0.0, **sampling}), max_len=64)
    seq.output_ids, seq.num_computed, seq.chunk_end = [4, 5], 4, 5
    return seq


@pytest.mark.parametrize("draft_tokens, seqs, lookup", [
    (4, [_seq(), _seq()], [1, 2, 3, 4, 5] * 2),
    (0, [_seq()], []),
    (4, [_seq(), _seq(temperature=0.7)], []),
    (4, [_seq(logprobs=2)], []),
    (4, [_seq(repetition_penalty=1.2)], []),
    (4, [_seq(logit_bias={5: 1.0})], []),
])  # fmt: skip
def test_the_gateway_sends_lookup_tokens_for_calls_of_greedy_rows(draft_tokens, seqs, lookup):
    request = multi_step_request(seqs, [[[0, 1]] * len(seqs)], "e", frozenset(), [], 0)
    with_lookup(request, seqs, draft_tokens)
    assert list(request.lookup_token_ids) == lookup
    assert request.draft_tokens == (draft_tokens if lookup else 0)
