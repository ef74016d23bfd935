"""Compute refuses out-of-range sampling controls and malformed token history before touching the pool."""

import pytest

from common.errors import InvalidArgument
from compute_service.validation import Limits, Sent, check_sent
from protos import compute_pb2
from tests.forward import forward_request

LIMITS = Limits(vocab_size=100, max_model_len=64, num_blocks=8, block_size=4)


def step(sampling: compute_pb2.RowSampling | None = None, **fields) -> Sent:
    request = forward_request([[1, 2, 3], [4]], [0, 0], [[0], [1]], block_size=4)
    if sampling is not None:
        request.sampling[1].CopyFrom(sampling)
    for name, value in fields.items():
        getattr(request, name).extend(value)
    return Sent.from_request(request)


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (dict(min_p=1.5), "sampling[1].min_p = 1.5 is invalid: it must be in [0, 1]"),
        (dict(repetition_penalty=0.0), "repetition_penalty = 0.0 is invalid: it must be > 0"),
        (dict(presence_penalty=2.5), "presence_penalty = 2.5 is invalid: it must be in [-2.0, 2.0]"),
        (dict(frequency_penalty=-3.0), "frequency_penalty = -3.0 is invalid"),
        (dict(logprobs=21), "logprobs = 21 is invalid: it must be in [0, 20]"),
        (dict(logprobs=-1), "logprobs = -1 is invalid"),
        (dict(min_tokens=-2), "min_tokens = -2 is invalid: it must be >= 0"),
        (dict(logit_bias={5: 101.0}), "sampling[1].logit_bias[5] = 101.0 is invalid: biases lie in [-100.0"),
        (dict(logit_bias={100: 1.0}), "logit_bias has token id 100, outside the vocabulary [0, 100)"),
        (
            dict(min_tokens=1, suppress_token_ids=[-4]),
            "suppress_token_ids has token id -4, outside the vocabulary",
        ),
        (dict(min_tokens=1), "output_lens has 0 entries for 2 sampling rows"),
    ],
)
def test_out_of_range_sampling_is_refused(sampling, message):
    with pytest.raises(InvalidArgument) as err:
        check_sent(step(compute_pb2.RowSampling(**sampling)), LIMITS)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(history_token_ids=[1, 2]), "need cu_history"),
        (dict(history_token_ids=[1, 2], cu_history=[0, 2], history_prompt_lens=[0]), "cu_history must run"),
        (dict(history_token_ids=[1, 2], cu_history=[0, 1, 3], history_prompt_lens=[0, 0]), "cu_history"),
        (dict(history_token_ids=[1, 2], cu_history=[0, 1, 2], history_prompt_lens=[2, 0]),
         "history_prompt_lens"),
        (dict(history_token_ids=[1, 200], cu_history=[0, 1, 2], history_prompt_lens=[0, 0]),
         "history_token_ids[1] = 200 is outside the vocabulary"),
        (dict(output_lens=[1]), "output_lens must be empty or 2 counts"),
        (dict(output_lens=[1, -1]), "output_lens must be empty or 2 counts >= 0"),
    ],
)  # fmt: skip
def test_malformed_history_is_refused(fields, message):
    with pytest.raises(InvalidArgument) as err:
        check_sent(step(**fields), LIMITS)
    assert message in str(err.value)


def test_well_formed_history_passes():
    check_sent(
        step(
            compute_pb2.RowSampling(
                repetition_penalty=1.2, min_tokens=2, suppress_token_ids=[2], logprobs=20
            ),
            history_token_ids=[1, 2, 3, 4, 9],
            cu_history=[0, 0, 5],
            history_prompt_lens=[0, 1],
            output_lens=[0, 4],
        ),
        LIMITS,
    )
