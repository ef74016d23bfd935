"""Greedy, top-k, top-p and seeded sampling over a packed batch."""

import pytest
import torch

from compute_service.sampling import SamplingBatch, sample
from protos import common_pb2

VOCAB = 64


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def batch(*params: common_pb2.SamplingParams) -> SamplingBatch:
    return SamplingBatch.from_params(params)


def draws(logits: torch.Tensor, params: common_pb2.SamplingParams, count: int = 2000) -> torch.Tensor:
    """`count` unseeded draws from one row of logits, as one batch."""
    rows = logits.expand(count, -1)
    return sample(rows, batch(*[params] * count), torch.zeros(count, dtype=torch.int64))[0]


def test_greedy_is_argmax_with_logprob_of_unscaled_logits():
    logits = torch.randn(5, VOCAB)
    tokens, logprobs = sample(logits, batch(*[common_pb2.SamplingParams(temperature=0)] * 5), torch.arange(5))
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).max(-1).values)


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(8, VOCAB)
    params = common_pb2.SamplingParams(temperature=2.0, top_k=1)
    tokens, _ = sample(logits, batch(*[params] * 8), torch.arange(8))
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_never_samples_outside_the_k_most_likely():
    logits = torch.randn(VOCAB)
    tokens = draws(logits, common_pb2.SamplingParams(temperature=1.5, top_k=5))
    allowed = set(logits.topk(5).indices.tolist())
    assert set(tokens.tolist()) == allowed


def test_top_p_never_samples_outside_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = torch.full((VOCAB,), -30.0)
    order = torch.randperm(VOCAB)[:5]
    logits[order] = probs.log()
    tokens = draws(logits, common_pb2.SamplingParams(temperature=1.0, top_p=0.75))
    # mass before the third most likely token is 0.8 >= 0.75: only the first two remain
    assert set(tokens.tolist()) == set(order[:2].tolist())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_follows_the_tempered_distribution(temperature: float):
    probs = torch.tensor([0.7, 0.2, 0.1])
    tokens = draws(probs.log(), common_pb2.SamplingParams(temperature=temperature), count=20000)
    freq = torch.bincount(tokens, minlength=3).float() / len(tokens)
    expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)


def test_seeded_row_is_independent_of_its_batch_companions():
    flat = torch.zeros(VOCAB)
    seeded = common_pb2.SamplingParams(temperature=1.0, seed=1234)
    alone = sample(flat[None], batch(seeded), torch.tensor([17]))[0]
    companions = [common_pb2.SamplingParams(temperature=0.7, top_k=3), common_pb2.SamplingParams(seed=9)]
    for _ in range(5):
        logits = torch.stack([torch.randn(VOCAB), flat, torch.randn(VOCAB)])
        tokens = sample(logits, batch(companions[0], seeded, companions[1]), torch.tensor([4, 17, 30]))[0]
        assert tokens[1] == alone[0]


def test_different_seeds_and_positions_draw_differently():
    flat = torch.zeros(64, VOCAB)
    by_seed = sample(
        flat, batch(*[common_pb2.SamplingParams(seed=s) for s in range(64)]), torch.full((64,), 5)
    )
    by_position = sample(flat, batch(*[common_pb2.SamplingParams(seed=7)] * 64), torch.arange(64))
    assert len(set(by_seed[0].tolist())) > 20
    assert len(set(by_position[0].tolist())) > 20
    again = sample(flat, batch(*[common_pb2.SamplingParams(seed=s) for s in range(64)]), torch.full((64,), 5))
    assert torch.equal(again[0], by_seed[0])
