"""Greedy agreement of narrower KV dtypes with float32 KV on the real model (float32 weights), through the
whole stack, over the parity prompts of test_generation.py (the figures: docs/configuration.md, KV dtypes)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cli.launch import Stack
from tests.e2e.greedy import assert_greedy_equal, concurrent_greedy, hf_greedy_gaps
from tests.e2e.prompts import PARITY_LENGTHS as LENGTHS
from tests.e2e.prompts import PARITY_NEW_TOKENS as NEW_TOKENS
from tests.e2e.prompts import prompt_ids
from tests.e2e.stack import start_stack

pytestmark = pytest.mark.e2e

# float16 keeps 10 mantissa bits: its K/V error (<= 2^-11 relative) moves logits by ~0.03, so greedy
# output may leave float32's only where its top two log-probabilities nearly tie (as bfloat16 does).
FLOAT16_TIE = 1 / 16
# NOTE: fp8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits: every K/V entry carries up to 6 % (12 %) rounding
# error, which moves SmolLM2-135M's logits by up to 3.4 (7.2) (cli/kv_report.py), so greedy paths part
# wherever the top two are not far apart. Measured in process (python -m cli.kv_report): tokens identical
# until the first divergence, summed over the 8 prompts of 32 tokens, 203/256 (e4m3) and 147/256 (e5m2).
# The floors leave ~15 % for the stack's other batching and prompt chunking, which round differently.
# fp8_e5m2 (the coarser one, measured in docs/configuration.md) is served end to end in test_kv_dtypes.py;
# here the two stacks of the real model keep the module near a minute.
FP8_FLOORS = {"fp8_e4m3": 170}
KV_DTYPES = ("float16", *FP8_FLOORS)


@pytest.fixture(scope="module")
def outputs(logs, tokenizer):
    """Each KV dtype's greedy tokens for the parity prompts, from its own stack (started side by side)."""
    prompts = prompt_ids(tokenizer, LENGTHS)

    def run(kv_dtype: str) -> list[list[int]]:
        stack: Stack = start_stack(logs, "--dtype", "float32", "--kv-dtype", kv_dtype, "--kv-blocks", "256")
        try:
            with stack.client() as client:
                assert client.info().kv_dtype == kv_dtype
            return [r.token_ids for r in concurrent_greedy(stack, prompts, NEW_TOKENS)]
        finally:
            assert stack.stop() == 0

    with ThreadPoolExecutor(len(KV_DTYPES)) as pool:
        return prompts, dict(zip(KV_DTYPES, pool.map(run, KV_DTYPES), strict=True))


@pytest.fixture(scope="module")
def reference(outputs, hf_models):
    """float32 transformers' greedy tokens and top-two gaps (the float32 stack equals them exactly)."""
    model = hf_models(torch.float32)
    return [hf_greedy_gaps(model, ids, NEW_TOKENS) for ids in outputs[0]]


def prefix_agreement(ours: list[list[int]], reference) -> int:
    """Tokens identical until the first divergence, summed over prompts."""
    total = 0
    for tokens, (expected, _) in zip(ours, reference, strict=True):
        differ = [k for k, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b]
        total += differ[0] if differ else len(expected)
    return total


def test_float16_kv_equals_float32_but_at_near_ties(outputs, reference):
    for tokens, (expected, gaps) in zip(outputs[1]["float16"], reference, strict=True):
        assert_greedy_equal(tokens, expected, gaps, FLOAT16_TIE)


@pytest.mark.parametrize("kv_dtype", list(FP8_FLOORS))
def test_fp8_kv_agreement_stays_above_its_measured_floor(outputs, reference, kv_dtype):
    agreed = prefix_agreement(outputs[1][kv_dtype], reference)
    assert agreed >= FP8_FLOORS[kv_dtype], f"{kv_dtype}: {agreed}/{len(LENGTHS) * NEW_TOKENS} tokens agree"
    # every output is whole text of the vocabulary, not garbage from a misread pool
    assert all(len(tokens) == NEW_TOKENS for tokens in outputs[1][kv_dtype])
