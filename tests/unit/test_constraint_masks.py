"""Constraint masks in compute (compute_service/constraints.py): the packed bitmasks of a Forward unpacked,
checked (rows, width, a mask allowing nothing) and applied after the other processors, so that every
sampling control draws only allowed tokens; ForwardSteps refuses constrained rows."""

import numpy as np
import pytest
import torch

from common.errors import InvalidArgument, RowsRefused
from compute_service.greedy import is_plain_greedy
from compute_service.multi_step import MultiStepPlan
from compute_service.sampling import SamplingBatch, sample
from compute_service.sampling_checks import check_sampling
from compute_service.validation import Limits
from protos import compute_pb2
from tests.forward import forward_request

VOCAB = 70  # not a multiple of 32: the last word is partly padding


def packed(*allowed: list[int]) -> bytes:
    """Rows of allowed token ids as ForwardRequest.constraint_bitmask."""
    words = (VOCAB + 31) // 32
    bits = np.zeros((len(allowed), words * 32), dtype=np.uint8)
    for row, tokens in enumerate(allowed):
        bits[row, tokens] = 1
    return np.packbits(bits, axis=1, bitorder="little").tobytes()


def batch(params: list[compute_pb2.RowSampling], rows: list[int], *allowed: list[int]) -> SamplingBatch:
    return SamplingBatch.from_params(params, constraint_rows=rows, constraint_bitmask=packed(*allowed))


@pytest.mark.parametrize(
    "params",
    [
        compute_pb2.RowSampling(temperature=0),
        compute_pb2.RowSampling(temperature=1.0),
        compute_pb2.RowSampling(temperature=1.5, top_k=3, top_p=0.9, min_p=0.05),
        compute_pb2.RowSampling(temperature=1.0, logit_bias={5: 100.0}, seed=3),
        compute_pb2.RowSampling(temperature=0.7, repetition_penalty=1.3, presence_penalty=1.0, logprobs=2),
    ],
)
def test_every_control_draws_only_the_allowed_tokens_of_a_constrained_row(params):
    torch.manual_seed(0)
    logits = torch.randn(64, VOCAB)
    allowed = [3, 40, 66]
    rows = list(range(0, 64, 2))
    b = SamplingBatch.from_params(
        [params] * 64,
        history=[t % VOCAB for t in range(64 * 2)],
        cu_history=list(range(0, 129, 2)),
        history_prompt_lens=[0] * 64,
        constraint_rows=rows,
        constraint_bitmask=packed(*[allowed] * len(rows)),
    )
    check_sampling(b, VOCAB)
    tokens = sample(logits, b, torch.arange(64)).tokens
    assert set(tokens[rows].tolist()) <= set(allowed)
    assert set(tokens[1::2].tolist()) - set(allowed), "unconstrained rows draw from the whole vocabulary"


def test_a_constrained_greedy_batch_leaves_the_fast_path_and_takes_the_best_allowed_token():
    logits = torch.randn(2, VOCAB)
    b = batch([compute_pb2.RowSampling(temperature=0)] * 2, [1], [7, 9])
    assert not is_plain_greedy(b)
    tokens = sample(logits, b, torch.arange(2)).tokens
    assert tokens[0] == logits[0].argmax()
    assert tokens[1] == (7 if logits[1, 7] >= logits[1, 9] else 9)


def test_logprobs_stay_those_of_the_raw_logits():
    logits = torch.randn(1, VOCAB)
    sampled = sample(
        logits, batch([compute_pb2.RowSampling(temperature=0, logprobs=1)], [0], [4]), torch.zeros(1)
    )
    assert sampled.tokens.item() == 4
    torch.testing.assert_close(sampled.logprobs, logits.log_softmax(-1)[:, 4])


@pytest.mark.parametrize(
    ("rows", "bitmask", "says"),
    [
        ([1, 0], packed([1], [1]), "ascending, distinct"),
        ([0, 0], packed([1], [1]), "ascending, distinct"),
        ([2], packed([1]), "indices of the 2 sampling rows"),
        ([0], packed([1]) + b"\0" * 4, "words; a vocabulary of 70 tokens needs 3"),
        ([0], packed([1])[:-2], "whole int32 words"),
        ([], packed([1]), "without constraint_rows"),
    ],
)
def test_malformed_masks_are_refused(rows, bitmask, says):
    with pytest.raises(InvalidArgument, match=says):
        b = SamplingBatch.from_params(
            [compute_pb2.RowSampling()] * 2, constraint_rows=rows, constraint_bitmask=bitmask
        )
        check_sampling(b, VOCAB)


def test_a_mask_that_allows_nothing_refuses_its_row_by_name():
    b = batch([compute_pb2.RowSampling()] * 3, [0, 2], [5], [])
    with pytest.raises(RowsRefused, match="row 2 allows no token") as info:
        check_sampling(b, VOCAB, torch.tensor([4, 5, 6]))
    assert info.value.rows == (6,)


def test_multi_step_calls_refuse_constrained_rows():
    first = forward_request([[5], [6]], [4, 2], [[0, 1], [2, 3]], block_size=4)
    first.constraint_rows[:] = [1]
    first.constraint_bitmask = packed([1])
    request = compute_pb2.StepsRequest(first=first, max_steps=[2, 2], cu_stop_token_ids=[0, 0, 0])
    with pytest.raises(InvalidArgument, match="ForwardSteps runs no constrained rows"):
        MultiStepPlan.check(request, Limits(vocab_size=VOCAB, max_model_len=64, num_blocks=16, block_size=4))
