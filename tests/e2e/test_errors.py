"""Bad input gets INVALID_ARGUMENT with an actionable message and leaves no block used."""

import grpc
import pytest

from protos import cache_pb2, compute_pb2
from sdk.client import GenerationError

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt=""), "empty prompt"),
        (dict(token_ids=[1, 2, 49152]), "token id 49152 is outside the vocabulary"),
        (dict(token_ids=[5, -1]), "token id -1 is outside the vocabulary"),
        (dict(prompt="hi", max_tokens=-3), "max_tokens must be >= 0"),
        (dict(prompt="hi", prompt_logprobs=21), "prompt_logprobs must be in [0, 20]"),
        (dict(prompts=["a", ""]), "prompts[1] must set exactly one of text and token_ids"),
        (dict(prompts=["a"], prompt="b"), "set prompts or prompt, not both"),
        (dict(prompts=["a"] * 65), "prompts has 65 entries; the limit is 64 (--max-prompts)"),
        (dict(prompt="hi", temperature=-1.0), "temperature must be >= 0"),
        (dict(prompt="hi", top_p=1.5), "top_p must be in (0, 1]"),
        (dict(prompt="hi", temperature=float("nan")), "temperature must be >= 0 and finite"),
        (dict(prompt="hi", frequency_penalty=float("-inf")), "frequency_penalty must be in [-2.0, 2.0]"),
        (dict(prompt="hi", top_k=-1), "top_k must be >= 0"),
        (dict(prompt="hi", token_ids=[1, 2]), "exactly one of prompt, token_ids or messages"),
        (dict(token_ids=[42] * 8192), "the model takes at most 8191"),
        (dict(messages=[{"role": "", "content": "hi"}]), "messages[0] has no role"),
        (dict(messages=[{"role": "hacker", "content": "hi"}]), "has role 'hacker': use one of system"),
        (dict(prompt="hi", min_p=1.5), "min_p must be in [0, 1]"),
        (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(prompt="hi", presence_penalty=2.5), "presence_penalty must be in [-2.0, 2.0]"),
        (dict(prompt="hi", frequency_penalty=-9.0), "frequency_penalty must be in [-2.0, 2.0]"),
        (dict(prompt="hi", logit_bias={49152: 1.0}), "logit_bias has 49152, outside the vocabulary"),
        (
            dict(prompt="hi", logit_bias={5: 101.0}),
            "logit_bias[5] = 101.0: biases must be in [-100.0, 100.0]",
        ),
        (dict(prompt="hi", logprobs=21), "logprobs must be in [0, 20]"),
        (dict(prompt="hi", max_tokens=4, min_tokens=5), "min_tokens must be in [0, max_tokens = 4]"),
        (dict(prompt="hi", stop=["ok", ""]), "stop takes at most 16 non-empty strings"),
        (dict(prompt="hi", stop=[str(i) for i in range(17)]), "stop takes at most 16 non-empty strings"),
    ],
)
def test_bad_requests_are_refused_without_leaking(stack_fp32, kwargs, message):
    with stack_fp32.client() as client, pytest.raises(GenerationError) as err:
        client.generate(**kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details
    stats = stack_fp32.stats()
    assert stats.used_blocks == 0
    assert stats.num_sequences == 0


def _forward(stack, **overrides) -> compute_pb2.ForwardRequest:
    epoch = stack.stats().pool_epoch
    request = dict(
        pool_epoch=epoch,
        token_ids=[1, 2, 3],
        cu_seqlens_q=[0, 3],
        num_computed=[0],
        block_tables=[0],
        block_table_width=1,
        sample=[True],
        sampling=[compute_pb2.RowSampling(temperature=0.0)],
    )
    request.update(overrides)
    return compute_pb2.ForwardRequest(**request)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(block_tables=[512]), "block"),
        (dict(block_tables=[-7]), "block"),
        (
            dict(
                cu_seqlens_q=[0, 1, 3],
                num_computed=[0, 0],
                block_tables=[0, 0],
                sample=[True, True],
                sampling=[compute_pb2.RowSampling(temperature=0.0)] * 2,
            ),
            "slot",
        ),
        (dict(token_ids=[1, 2, 10**6]), "token"),
        (dict(sampling=[compute_pb2.RowSampling(logprobs=50)]), "sampling[0].logprobs = 50 is invalid"),
        (dict(sampling=[compute_pb2.RowSampling(temperature=float("inf"))]), "sampling[0].temperature = inf"),
        (dict(history_token_ids=[1, 99999], cu_history=[0, 2], history_prompt_lens=[1]), "history_token_ids"),
    ],
)
def test_compute_refuses_forward_outside_the_pool(stack_fp32, overrides, message):
    before = stack_fp32.cache().ReadBlock(cache_pb2.ReadBlockRequest(block_id=0, layer=0, include_data=True))
    with pytest.raises(grpc.RpcError) as err:
        stack_fp32.compute().Forward(_forward(stack_fp32, **overrides), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details().lower()
    after = stack_fp32.cache().ReadBlock(cache_pb2.ReadBlockRequest(block_id=0, layer=0, include_data=True))
    assert after.data == before.data


def test_compute_refuses_a_stale_pool_epoch(stack_fp32):
    with pytest.raises(grpc.RpcError) as err:
        stack_fp32.compute().Forward(_forward(stack_fp32, pool_epoch="not-the-epoch"), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
