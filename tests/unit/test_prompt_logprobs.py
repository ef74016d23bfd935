"""Prompt log-probabilities in compute (ForwardRequest.prompt_*): a prompt scored in two chunks beside another
row, each target's log-probability, rank and top alternatives equal to transformers' own float32
log_softmax within 1e-4; malformed targets refused naming the field, and by ForwardSteps."""

import re

import pytest
import torch

from common.errors import InvalidArgument
from compute_service.batch import ForwardBatch
from compute_service.multi_step import MultiStepPlan
from compute_service.prompt_logprobs import reply_fields
from compute_service.validation import Limits
from protos import compute_pb2
from tests.forward import forward_request
from tests.paged_greedy import BLOCK_SIZE, PROMPT_A, PROMPT_B, Served, reference
from tests.tiny_model import save_tiny_llama

TOP = 3
SPLIT = 17


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("prompt-logprobs") / "tiny", initializer_range=0.3)


def hf_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: transformers' float32 log_softmax at each position, predicting the next."""
    with torch.inference_mode():
        logits = reference(path)(torch.tensor([prompt])).logits[0, :-1]
    return logits.float().log_softmax(-1)


def scored(served: Served, new, cached, tables, sample, asked, targets):
    request = forward_request(new, cached, tables, block_size=BLOCK_SIZE, sample=sample)
    request.prompt_logprobs.extend(asked)
    for row_targets in targets:
        request.prompt_target_ids.extend(row_targets)
    request.cu_prompt_targets.extend([0] + list(torch.tensor([len(t) for t in targets]).cumsum(0).tolist()))
    sampled = served.runner.forward(ForwardBatch.from_request(request, served.limits))
    return reply_fields(sampled.prompt)


def test_a_chunked_prompt_is_scored_as_transformers_scores_it(tiny):
    served = Served(tiny, "cpu-native")
    a, b = list(range(0, 13)), list(range(13, 24))
    # step 1: A's first chunk (its targets: the tokens after each of its new tokens) beside B's whole prompt
    first = scored(
        served, [PROMPT_A[:SPLIT], PROMPT_B], [0, 0], [a, b], [False, True], [TOP, TOP],
        [PROMPT_A[1 : SPLIT + 1], PROMPT_B[1:]],
    )  # fmt: skip
    # step 2: A's second chunk alone, the last token sampling (it has no target)
    second = scored(served, [PROMPT_A[SPLIT:]], [SPLIT], [a], [True], [0], [PROMPT_A[SPLIT + 1 :]])
    expected_a, expected_b = hf_logprobs(tiny, PROMPT_A), hf_logprobs(tiny, PROMPT_B)
    width = first["prompt_top_width"]
    assert width == TOP and second["prompt_top_width"] == 0, "the widest row's width; none asked, none"
    got_a = first["prompt_logprobs"][:SPLIT] + second["prompt_logprobs"]
    got_b = first["prompt_logprobs"][SPLIT:]
    for got, prompt, expected in ((got_a, PROMPT_A, expected_a), (got_b, PROMPT_B, expected_b)):
        chosen = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert len(got) == len(prompt) - 1
        torch.testing.assert_close(torch.tensor(got), chosen, atol=1e-4, rtol=0)
    ranks = first["prompt_ranks"][:SPLIT] + second["prompt_ranks"]
    chosen_a = expected_a.gather(1, torch.tensor(PROMPT_A[1:])[:, None])
    assert ranks == (expected_a >= chosen_a - 1e-6).sum(1).tolist()
    top_ids = torch.tensor(first["prompt_top_token_ids"]).view(-1, TOP)
    top = torch.tensor(first["prompt_top_logprobs"]).view(-1, TOP)
    hf_top = torch.cat((expected_a[:SPLIT], expected_b)).topk(TOP)
    assert top_ids.tolist() == hf_top.indices.tolist()
    torch.testing.assert_close(top, hf_top.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("asked", "targets", "cu", "message"),
    [
        ([0, 0], [], [0], "prompt_logprobs has 2 entries for 1 sequences"),
        ([21], [5], [0, 1], "prompt_logprobs entries must be in [-1, 20]"),
        ([0], [5], [0, 2], "cu_prompt_targets must run from 0 to len(prompt_target_ids) (1)"),
        ([0], [5] * 5, [0, 5], "more prompt targets than new tokens"),
        ([0], [10**6], [0, 1], "prompt_target_ids has ids outside the vocabulary"),
        ([-1], [5], [0, 1], "prompt_target_ids and cu_prompt_targets need rows with prompt_logprobs"),
    ],
)
def test_malformed_prompt_targets_are_refused_naming_the_field(tiny, asked, targets, cu, message):
    served = Served(tiny, "cpu-native")
    request = forward_request([PROMPT_A[:4]], [0], [[0]], block_size=BLOCK_SIZE)
    request.prompt_logprobs.extend(asked)
    request.prompt_target_ids.extend(targets)
    request.cu_prompt_targets.extend(cu)
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        ForwardBatch.from_request(request, served.limits)


def test_multi_step_calls_refuse_prompt_targets():
    first = forward_request([[5], [6]], [4, 2], [[0, 1], [2, 3]], block_size=4)
    first.prompt_logprobs[:] = [0, -1]
    first.prompt_target_ids[:] = [7]
    first.cu_prompt_targets[:] = [0, 1]
    request = compute_pb2.StepsRequest(first=first, max_steps=[2, 2], cu_stop_token_ids=[0, 0, 0])
    with pytest.raises(InvalidArgument, match="ForwardSteps scores no prompt tokens"):
        MultiStepPlan.check(request, Limits(vocab_size=64, max_model_len=64, num_blocks=16, block_size=4))
