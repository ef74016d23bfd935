"""The plain-greedy fast path (compute_service.greedy), native and in torch, returns what `sample` returns for
such a batch."""

import pytest
import torch

from compute_service import kernels
from compute_service.greedy import greedy, is_plain_greedy
from compute_service.sampling import SamplingBatch, sample
from protos import compute_pb2

GREEDY = compute_pb2.RowSampling(temperature=0)


NATIVE = pytest.param(
    kernels.load(),
    id="native",
    marks=pytest.mark.skipif(kernels.load() is None, reason="the native kernels cannot be built here"),
)


@pytest.mark.parametrize("kernels", [NATIVE, pytest.param(None, id="torch")])
@pytest.mark.parametrize("rows, vocab", [(1, 1000), (3, 1000), (64, 49_157)])
def test_greedy_equals_sample_on_a_plain_greedy_batch(kernels, rows, vocab):
    torch.manual_seed(rows)
    logits = torch.randn(rows, vocab) * 4
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first index wins
    if rows > 1:
        logits[-1, -1] = logits[-1].max() + 0.5  # the most likely token in the last, partial lane group
    batch = SamplingBatch.from_params([GREEDY] * rows)
    assert is_plain_greedy(batch)
    expected, got = sample(logits, batch, torch.arange(rows)), greedy(logits, kernels)
    assert torch.equal(got.tokens, expected.tokens) and int(got.tokens[0]) == 7
    assert rows == 1 or int(got.tokens[-1]) == vocab - 1
    # NOTE: a log-probability is -log Σ exp(logit - max) over the vocabulary, summed in float32. Rounded at
    # every add, such a sum of V terms is off by about √V·u relatively (u = 2⁻²⁴) and log Σ by as much
    # absolutely; which terms share a vector lane (8 with AVX2, 16 with AVX-512) and so the roundings change
    # with the ISA and the path. Both paths are held to 8·√V·u of the float64 value.
    exact = torch.log_softmax(logits.double(), 1).gather(1, got.tokens[:, None]).squeeze(1)
    for logprobs in (got.logprobs, expected.logprobs):
        torch.testing.assert_close(logprobs.double(), exact, atol=8 * vocab**0.5 * 2**-24, rtol=0)
    assert got.top_ids.shape == expected.top_ids.shape == (0, 0)
    assert got.top_logprobs.shape == expected.top_logprobs.shape


@pytest.mark.parametrize(
    "row",
    [
        compute_pb2.RowSampling(temperature=0.7),
        compute_pb2.RowSampling(temperature=0, logprobs=2),
        compute_pb2.RowSampling(temperature=0, logit_bias={5: 2.0}),
        compute_pb2.RowSampling(temperature=0, min_tokens=2, suppress_token_ids=[2]),
    ],
    ids=["temperature", "logprobs", "logit_bias", "min_tokens"],
)
def test_any_row_that_sample_would_treat_otherwise_takes_the_full_path(row):
    assert not is_plain_greedy(SamplingBatch.from_params([GREEDY, row]))


def test_a_penalty_history_takes_the_full_path():
    batch = SamplingBatch.from_params(
        [GREEDY], history=[4, 5], cu_history=[0, 2], history_prompt_lens=[1], output_lens=[1]
    )
    assert not is_plain_greedy(batch)
