"""A non-default block size serves the same greedy tokens as transformers through the whole stack."""

import pytest
import torch

from tests.e2e.greedy import concurrent_greedy, hf_greedy
from tests.e2e.prompts import prompt_ids
from tests.e2e.stack import start_stack

pytestmark = pytest.mark.e2e

NEW_TOKENS = 12


# NOTE: 16 is the default the parity tests in test_generation.py run; the compute path at 16, 32, 64 and 128
# is checked against transformers in tests/unit/test_runner.py; here the largest runs through all services.
@pytest.mark.parametrize("block_size", [128])
def test_greedy_parity_at_block_size(block_size, logs, tokenizer, hf_models):
    # a prompt inside one block, one that crosses a block boundary while decoding, one of several blocks
    prompts = prompt_ids(tokenizer, [7, block_size - 4, 2 * block_size + 9])
    stack = start_stack(
        logs, "--dtype", "float32", "--block-size", str(block_size), "--kv-blocks", "32", "--max-seqs", "8"
    )
    try:
        results = concurrent_greedy(stack, prompts, NEW_TOKENS)
        assert stack.stats().block_size == block_size
        assert stack.stats().used_blocks == 0
    finally:
        stack.stop()
    model = hf_models(torch.float32)
    for ids, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(model, ids, NEW_TOKENS), f"prompt of {len(ids)} tokens diverged"
