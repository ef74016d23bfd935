"""Greedy agreement of int8 weights and of bfloat16 linears (mixed precision) with float32 on the real model
(float32 activations), through the whole stack, over the parity prompts of test_generation.py (the figures:
docs/configuration.md, Quantised weights)."""

import pytest
import torch

from tests.e2e.greedy import concurrent_greedy, hf_greedy
from tests.e2e.prompts import PARITY_LENGTHS as LENGTHS
from tests.e2e.prompts import PARITY_NEW_TOKENS as NEW_TOKENS
from tests.e2e.prompts import prompt_ids
from tests.e2e.stack import start_stack
from tests.tiny_model import needs_native_bfloat16

pytestmark = pytest.mark.e2e

# NOTE: int8 per-channel weights carry ~0.7 % relative error per linear (bfloat16 activations in the kernel
# add ~0.4 %), which moves SmolLM2-135M's logits enough to part greedy paths wherever the top two are close
# (perplexity moves by only +0.14 %). Measured in process (python -m cli.weights_report): tokens identical
# until the first divergence, summed over the 8 prompts of 32 tokens, 186/256 (5/8 prompts identical). The
# floor leaves ~15 % for the stack's batching and prompt chunking, which round differently (and take the
# dense GEMM or the kernel at other steps).
# bfloat16 linears (bfloat16-rounded weights and inputs, float32 accumulation): 229/256 in the report (7/8
# prompts identical), 197-198/256 in process on the cpu-native backend, 171/256 through this stack (int8: 186
# here); its floor is ~15 % below the stack's figure.
# --weights: (measured, floor through the stack)
FLOORS = {"int8": (186, 158), "bfloat16": (171, 145)}


@pytest.fixture(
    scope="module",
    params=["int8", pytest.param("bfloat16", marks=needs_native_bfloat16)],
)
def outputs(request, logs, tokenizer):
    prompts = prompt_ids(tokenizer, LENGTHS)
    stack = start_stack(logs, "--dtype", "float32", "--weights", request.param, "--kv-blocks", "256")
    try:
        with stack.client() as client:
            info = client.info()
            assert (info.weights, info.dtype) == (request.param, "float32")
        return request.param, prompts, [r.token_ids for r in concurrent_greedy(stack, prompts, NEW_TOKENS)]
    finally:
        assert stack.stop() == 0


def prefix_agreement(ours: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens identical until the first divergence, summed over prompts."""
    total = 0
    for tokens, expected in zip(ours, reference, strict=True):
        differ = [k for k, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b]
        total += differ[0] if differ else len(expected)
    return total


def test_agreement_with_float32_stays_above_its_measured_floor(outputs, hf_models):
    weights, prompts, tokens = outputs
    model = hf_models(torch.float32)
    reference = [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]
    agreed = prefix_agreement(tokens, reference)
    total = len(LENGTHS) * NEW_TOKENS
    measured, floor = FLOORS[weights]
    assert agreed >= floor, f"{weights}: {agreed}/{total} tokens agree ({measured} measured)"
    assert all(len(t) == NEW_TOKENS for t in tokens)
