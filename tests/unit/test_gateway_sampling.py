"""The gateway's side of sampling: requests resolved and checked, compute fields built, logprobs read back."""

import pytest
import torch

from common.errors import InvalidArgument
from compute_service.sampling import SamplingBatch, process
from gateway.sampling import forward_sampling, resolve_sampling, token_logprobs
from gateway.sequence import Sequence
from protos import compute_pb2, generation_pb2

VOCAB, EOS = 50, frozenset({2})


def seq(prompt: list[int], output: list[int], **params) -> Sequence:
    sampling = resolve_sampling(generation_pb2.SamplingParams(temperature=0, max_tokens=20, **params), VOCAB)
    return Sequence(seq_id="s", prompt_ids=prompt, sampling=sampling, max_len=100, output_ids=output)


def test_history_goes_only_with_the_penalties_that_need_it():
    seqs = [
        seq([1, 3, 3], [4, 4, 5], repetition_penalty=1.5, frequency_penalty=0.5),
        seq([7, 8], [9], presence_penalty=1.0),
        seq([10, 11], [12]),
    ]
    fields = forward_sampling(seqs, EOS)
    assert fields["history_token_ids"] == [1, 3, 3, 4, 4, 5, 9]
    assert fields["cu_history"] == [0, 6, 7, 7]
    assert fields["history_prompt_lens"] == [3, 0, 0]
    assert "output_lens" not in fields
    assert set(forward_sampling([seqs[2]], EOS)) == {"sampling"}, "no penalty: no history at all"


def test_the_history_applies_the_penalties_as_defined_on_the_compute_side():
    seqs = [seq([1, 3, 3], [4, 4, 5], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    batch = SamplingBatch.from_request(compute_pb2.ForwardRequest(**forward_sampling(seqs, EOS)))
    logits = torch.linspace(-5, 5, VOCAB)[None]
    out = process(logits, batch)[0]
    expected = logits[0].clone()
    for token in (1, 3, 4, 5):
        expected[token] = expected[token] / 2 if expected[token] > 0 else expected[token] * 2
    expected[4] -= 2 * 0.5 + 0.25
    expected[5] -= 0.5 + 0.25
    torch.testing.assert_close(out, expected)


def test_min_tokens_sends_stop_ids_and_eos_only_while_pending():
    pending = seq([1], [4], min_tokens=3, stop_token_ids=[9])
    ignoring = seq([1], [4, 5], min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    done = seq([1], [4, 5, 6], min_tokens=3, stop_token_ids=[9])
    fields = forward_sampling([pending, ignoring, done], EOS)
    assert fields["output_lens"] == [1, 2, 3]
    assert [(p.min_tokens, sorted(p.suppress_token_ids)) for p in fields["sampling"]] == [
        (3, [2, 9]),
        (3, [9]),
        (0, []),
    ]
    assert "output_lens" not in forward_sampling([done], EOS)


def test_gateway_stop_reason_waits_for_min_tokens():
    early = seq([1], [2], min_tokens=2)
    assert early.stop_reason(EOS) is None
    early.output_ids.append(2)
    assert early.stop_reason(EOS) == "stop"


def test_token_logprobs_unpack_the_rows_that_asked():
    seqs = [seq([1], [], logprobs=2), seq([1], []), seq([1], [], logprobs=0)]
    reply = compute_pb2.ForwardResponse(
        token_ids=[5, 6, 7],
        logprobs=[-0.5, -1.0, -1.5],
        top_logprobs_width=2,
        top_token_ids=[5, 8, 7, 1],
        top_logprobs=[-0.5, -2.0, -1.5, -3.0],
    )
    first, second, third = token_logprobs(reply, seqs)
    assert (first.token_id, first.logprob, list(first.top_token_ids), list(first.top_logprobs)) == (
        5, -0.5, [5, 8], [-0.5, -2.0]
    )  # fmt: skip
    assert second is None
    assert (third.token_id, list(third.top_token_ids)) == (7, [])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(min_p=-0.1), "min_p must be in [0, 1]"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty must be > 0"),
        (dict(presence_penalty=float("nan")), "presence_penalty must be in [-2.0, 2.0]"),
        (dict(logit_bias={-1: 0.0}), "logit_bias has -1, outside the vocabulary [0, 50)"),
        (dict(logprobs=-1), "logprobs must be in [0, 20]"),
        (dict(min_tokens=-1), "min_tokens must be in [0, max_tokens = 16]"),
    ],
)
def test_out_of_range_controls_are_refused_with_the_range(params, message):
    with pytest.raises(InvalidArgument) as err:
        resolve_sampling(generation_pb2.SamplingParams(**params), VOCAB)
    assert message in str(err.value)
