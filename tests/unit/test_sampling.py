"""Greedy, top-k, top-p and seeded sampling over a packed batch."""

import pytest
import torch

from compute_service.sampling import SamplingBatch, process, sample
from protos import compute_pb2

VOCAB = 64


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def batch(*params: compute_pb2.RowSampling) -> SamplingBatch:
    return SamplingBatch.from_params(params)


def draws(logits: torch.Tensor, params: compute_pb2.RowSampling, count: int = 2000) -> torch.Tensor:
    """`count` unseeded draws from one row of logits, as one batch."""
    rows = logits.expand(count, -1)
    return sample(rows, batch(*[params] * count), torch.zeros(count, dtype=torch.int64)).tokens


def test_greedy_is_argmax_with_logprob_of_unscaled_logits():
    logits = torch.randn(5, VOCAB)
    sampled = sample(logits, batch(*[compute_pb2.RowSampling(temperature=0)] * 5), torch.arange(5))
    assert torch.equal(sampled.tokens, logits.argmax(-1))
    torch.testing.assert_close(sampled.logprobs, logits.log_softmax(-1).max(-1).values)


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(8, VOCAB)
    params = compute_pb2.RowSampling(temperature=2.0, top_k=1)
    tokens = sample(logits, batch(*[params] * 8), torch.arange(8)).tokens
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_never_samples_outside_the_k_most_likely():
    logits = torch.randn(VOCAB)
    tokens = draws(logits, compute_pb2.RowSampling(temperature=1.5, top_k=5))
    allowed = set(logits.topk(5).indices.tolist())
    assert set(tokens.tolist()) == allowed


def test_top_p_never_samples_outside_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = torch.full((VOCAB,), -30.0)
    order = torch.randperm(VOCAB)[:5]
    logits[order] = probs.log()
    tokens = draws(logits, compute_pb2.RowSampling(temperature=1.0, top_p=0.75))
    # mass before the third most likely token is 0.8 >= 0.75: only the first two remain
    assert set(tokens.tolist()) == set(order[:2].tolist())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_follows_the_tempered_distribution(temperature: float):
    probs = torch.tensor([0.7, 0.2, 0.1])
    tokens = draws(probs.log(), compute_pb2.RowSampling(temperature=temperature), count=20000)
    freq = torch.bincount(tokens, minlength=3).float() / len(tokens)
    expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)


def test_seeded_row_is_independent_of_its_batch_companions():
    flat = torch.zeros(VOCAB)
    seeded = compute_pb2.RowSampling(temperature=1.0, seed=1234)
    alone = sample(flat[None], batch(seeded), torch.tensor([17])).tokens
    companions = [compute_pb2.RowSampling(temperature=0.7, top_k=3), compute_pb2.RowSampling(seed=9)]
    for _ in range(5):
        logits = torch.stack([torch.randn(VOCAB), flat, torch.randn(VOCAB)])
        tokens = sample(logits, batch(companions[0], seeded, companions[1]), torch.tensor([4, 17, 30])).tokens
        assert tokens[1] == alone[0]


def test_different_seeds_and_positions_draw_differently():
    flat = torch.zeros(64, VOCAB)
    by_seed = sample(flat, batch(*[compute_pb2.RowSampling(seed=s) for s in range(64)]), torch.full((64,), 5))
    by_position = sample(flat, batch(*[compute_pb2.RowSampling(seed=7)] * 64), torch.arange(64))
    assert len(set(by_seed.tokens.tolist())) > 20
    assert len(set(by_position.tokens.tolist())) > 20
    again = sample(flat, batch(*[compute_pb2.RowSampling(seed=s) for s in range(64)]), torch.full((64,), 5))
    assert torch.equal(again.tokens, by_seed.tokens)


def test_a_seeded_draw_depends_on_its_seed_and_position_alone():
    """What a resumed stream relies on: drawn from position 25 on, in a batch of another size, after other
    draws, the tokens are those of the run from position 0; unseeded rows stay random."""
    logits = torch.randn(VOCAB)
    params = compute_pb2.RowSampling(temperature=1.0, seed=99)
    unbroken = [int(sample(logits[None], batch(params), torch.tensor([p])).tokens) for p in range(40)]
    assert len(set(unbroken)) > 5
    torch.manual_seed(12345)
    rows = logits.expand(15, -1)
    resumed = sample(rows, batch(*[params] * 15), torch.arange(25, 40)).tokens.tolist()
    assert resumed == unbroken[25:]
    unseeded = compute_pb2.RowSampling(temperature=1.0)
    twice = [sample(rows, batch(*[unseeded] * 15), torch.arange(25, 40)).tokens.tolist() for _ in range(2)]
    assert twice[0] != twice[1]


def seeded_draws(logits: torch.Tensor, count: int = 400, **fields) -> set[int]:
    """Tokens drawn from one row of logits by `count` rows with different seeds."""
    params = [compute_pb2.RowSampling(seed=s, **fields) for s in range(count)]
    return set(sample(logits.expand(count, -1), batch(*params), torch.full((count,), 3)).tokens.tolist())


def test_same_seed_same_parameters_same_draw():
    logits = torch.randn(4, VOCAB)
    params = compute_pb2.RowSampling(
        seed=11, temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
        presence_penalty=0.5, frequency_penalty=0.2, logit_bias={3: 2.0},
    )  # fmt: skip
    history = dict(history=[1, 2, 3, 4] * 4, cu_history=[0, 4, 8, 12, 16], history_prompt_lens=[2] * 4)
    first = sample(logits, SamplingBatch.from_params([params] * 4, **history), torch.arange(4))
    again = sample(logits, SamplingBatch.from_params([params] * 4, **history), torch.arange(4))
    assert torch.equal(first.tokens, again.tokens)


def probs_logits(probs: list[float]) -> tuple[torch.Tensor, list[int]]:
    """A vocabulary where `probs` sit on random token ids (most likely first) and the rest is negligible."""
    logits = torch.full((VOCAB,), -40.0)
    ids = torch.randperm(VOCAB)[: len(probs)]
    logits[ids] = torch.tensor(probs).log()
    return logits, ids.tolist()


@pytest.mark.parametrize(
    ("fields", "support"),
    [
        (dict(top_k=3), 3),
        (dict(top_p=0.85), 3),  # mass before the 4th is 0.9 >= 0.85; before the 3rd 0.7 < 0.85
        (dict(min_p=0.3), 3),  # 0.1 / 0.4 = 0.25 < 0.3 <= 0.2 / 0.4
        (dict(min_p=0.3, temperature=0.5), 2),  # tempered: (0.2 / 0.4)^2 = 0.25 < 0.3
        (dict(top_k=4, top_p=0.95, min_p=0.3), 3),  # min_p binds
    ],
)
def test_filters_draw_exactly_their_support(fields, support):
    logits, ids = probs_logits([0.4, 0.3, 0.2, 0.1])
    assert seeded_draws(logits, **fields) == set(ids[:support])


def test_min_p_zero_and_one_are_off_and_greedy():
    logits, ids = probs_logits([0.4, 0.3, 0.2, 0.1])
    assert seeded_draws(logits, min_p=0.0) == set(ids)
    assert seeded_draws(logits, min_p=1.0) == {ids[0]}


def reference_penalties(logits, history, prompt_len, repetition, presence, frequency):
    """The definitions, one token at a time: HF/vLLM repetition over prompt + output, OpenAI over output."""
    out = logits.clone()
    for token in set(history):
        value = out[token]
        out[token] = value / repetition if value > 0 else value * repetition
    output = history[prompt_len:]
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_penalties_change_logits_exactly_as_defined(layout):
    """`transposed`: a strided view of logits (found by the fuzz suite when the output head returned one: a
    penalized row beside another failed the whole step with INTERNAL, "view size is not compatible")."""
    logits = torch.randn(3, VOCAB) * 3
    if layout == "transposed":
        logits = logits.t().contiguous().t()
        assert not logits.is_contiguous()
    rows = [
        dict(history=[5, 6, 7, 5, 9, 9, 9], prompt_len=3, repetition=1.5, presence=0.7, frequency=0.3),
        dict(history=[], prompt_len=0, repetition=1.0, presence=0.0, frequency=0.0),
        dict(history=[1, 1, 2, 40], prompt_len=0, repetition=1.0, presence=-0.5, frequency=1.25),
    ]
    params = [
        compute_pb2.RowSampling(
            repetition_penalty=r["repetition"],
            presence_penalty=r["presence"],
            frequency_penalty=r["frequency"],
        )
        for r in rows
    ]
    lengths = [len(r["history"]) for r in rows]
    penalized = process(
        logits,
        SamplingBatch.from_params(
            params,
            history=[t for r in rows for t in r["history"]],
            cu_history=[0, *torch.tensor(lengths).cumsum(0).tolist()],
            history_prompt_lens=[r["prompt_len"] for r in rows],
        ),
    )
    for row, r in enumerate(rows):
        torch.testing.assert_close(penalized[row], reference_penalties(logits[row], **r))
    assert torch.equal(penalized[1], logits[1])
    assert (penalized[0] != logits[0]).sum() == 4  # tokens 5, 6, 7, 9


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.randn(64, VOCAB)
    forced = [compute_pb2.RowSampling(seed=s, temperature=1.0, logit_bias={13: 100.0}) for s in range(32)]
    greedy = [compute_pb2.RowSampling(temperature=0, logit_bias={13: 100.0}) for _ in range(32)]
    sampled = sample(logits, batch(*forced, *greedy), torch.arange(64))
    assert sampled.tokens.tolist() == [13] * 64
    # the reported log-probability is the raw model's, not the biased one
    torch.testing.assert_close(sampled.logprobs, logits.log_softmax(-1)[:, 13])
    top = logits.argmax(-1)
    banned = [compute_pb2.RowSampling(temperature=0, logit_bias={int(t): -100.0}) for t in top]
    assert not (sample(logits, batch(*banned), torch.arange(64)).tokens == top).any()


def test_min_tokens_suppresses_stop_ids_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = logits[:, 9] = 50.0  # stop ids that would always win
    params = compute_pb2.RowSampling(temperature=1.0, min_tokens=3, suppress_token_ids=[7, 9])
    for generated, suppressed in ((0, True), (2, True), (3, False), (10, False)):
        seeded = [compute_pb2.RowSampling(seed=s) for s in range(2)]
        for p in seeded:
            p.MergeFrom(params)
        tokens = sample(
            logits, SamplingBatch.from_params(seeded, output_lens=[generated] * 2), torch.arange(2)
        ).tokens
        assert set(tokens.tolist()).isdisjoint({7, 9}) == suppressed
    # without min_tokens, stop ids are just tokens
    plain = sample(
        logits[:1], batch(compute_pb2.RowSampling(temperature=0, suppress_token_ids=[7])), torch.arange(1)
    )
    assert plain.tokens.item() == 7


def test_logprobs_top_n_are_topk_of_the_raw_log_softmax():
    logits = torch.randn(4, VOCAB)
    params = [
        compute_pb2.RowSampling(temperature=0, logprobs=5),
        compute_pb2.RowSampling(temperature=1.0, seed=1),
        compute_pb2.RowSampling(temperature=0.7, seed=2, logprobs=0, repetition_penalty=1.5),
        compute_pb2.RowSampling(temperature=0, logprobs=20, logit_bias={0: 30.0}),
    ]
    sampled = sample(logits, batch(*params), torch.arange(4))
    expected = logits.log_softmax(-1)[[0, 2, 3]].topk(20)
    assert sampled.top_ids.shape == (3, 20)
    assert torch.equal(sampled.top_ids, expected.indices)
    torch.testing.assert_close(sampled.top_logprobs, expected.values)
    torch.testing.assert_close(
        sampled.logprobs, logits.log_softmax(-1).gather(1, sampled.tokens[:, None])[:, 0]
    )
    none = sample(logits[:1], batch(compute_pb2.RowSampling(temperature=0)), torch.arange(1))
    assert none.top_ids.shape == (0, 0)
