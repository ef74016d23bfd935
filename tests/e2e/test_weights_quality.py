"""Greedy agreement of int8 weights with float32 on the real model (float32 activations), through the whole
stack, over the parity prompts of test_generation.py (the figures: README "Quantised weights")."""

import pytest
import torch

from tests.e2e.greedy import concurrent_greedy, hf_greedy
from tests.e2e.prompts import PARITY_LENGTHS as LENGTHS
from tests.e2e.prompts import PARITY_NEW_TOKENS as NEW_TOKENS
from tests.e2e.prompts import prompt_ids
from tests.e2e.stack import start_stack

pytestmark = pytest.mark.e2e

# NOTE: int8 per-channel weights carry ~0.7 % relative error per linear (bfloat16 activations in the kernel
# add ~0.4 %), which moves SmolLM2-135M's logits enough to part greedy paths wherever the top two are close
# (perplexity moves by only +0.14 %). Measured in process (python -m cli.weights_report): tokens identical
# until the first divergence, summed over the 8 prompts of 32 tokens, 186/256 (5/8 prompts identical). The
# floor leaves ~15 % for the stack's batching and prompt chunking, which round differently (and take the
# dense GEMM or the kernel at other steps).
INT8_MEASURED = 186
INT8_FLOOR = 158


@pytest.fixture(scope="module")
def outputs(logs, tokenizer):
    prompts = prompt_ids(tokenizer, LENGTHS)
    stack = start_stack(logs, "--dtype", "float32", "--weights", "int8", "--kv-blocks", "256")
    try:
        with stack.client() as client:
            assert client.info().weights == "int8"
        return prompts, [r.token_ids for r in concurrent_greedy(stack, prompts, NEW_TOKENS)]
    finally:
        assert stack.stop() == 0


def prefix_agreement(ours: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens identical until the first divergence, summed over prompts."""
    total = 0
    for tokens, expected in zip(ours, reference, strict=True):
        differ = [k for k, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b]
        total += differ[0] if differ else len(expected)
    return total


def test_int8_agreement_with_float32_stays_above_its_measured_floor(outputs, hf_models):
    prompts, tokens = outputs
    model = hf_models(torch.float32)
    reference = [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]
    agreed = prefix_agreement(tokens, reference)
    total = len(LENGTHS) * NEW_TOKENS
    assert agreed >= INT8_FLOOR, f"int8: {agreed}/{total} tokens agree ({INT8_MEASURED} measured in process)"
    assert all(len(t) == NEW_TOKENS for t in tokens)
