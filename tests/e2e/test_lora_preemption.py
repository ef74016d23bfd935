"""Preemption and recompute with LoRA adapters (docs/adapters.md): one prompt on the base model and three
PEFT adapters, and another on two of them, all at once behind a KV pool too small for them, run out of
blocks; the preempted ones are recomputed (through the prefix cache, whose blocks are rooted at their
adapter) and each still gives peft's greedy tokens (float32), as when run alone: the same prompt on four
adapters never reads another adapter's KV."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.e2e.greedy import hf_greedy
from tests.e2e.stack import preemptions, start_stack
from tests.lora_adapters import LLAMA_ATTENTION, LLAMA_MLP, peft_model, save_tiny_with_adapters

pytestmark = pytest.mark.e2e

NEW_TOKENS = 24
# NOTE: a request is 41 or 33 prompt tokens and 24 new ones, 9 or 8 blocks of 8: 16 blocks hold one whole and
# most of another, so six at once outgrow them while prefilling and decoding.
FLAGS = (
    *("--dtype", "float32", "--kv-blocks", "16", "--block-size", "8", "--max-batched-tokens", "24"),
    *("--max-loras", "4", "--max-lora-rank", "8"),
)
# name -> (rank, targets, rsLoRA)
ADAPTERS = {
    "sql": (4, ["q_proj", "v_proj"], False),
    "chat": (8, LLAMA_ATTENTION + LLAMA_MLP, True),
    "code": (2, ["o_proj", "gate_proj", "down_proj"], False),
}
_generator = torch.Generator().manual_seed(23)
SHARED, OTHER = (torch.randint(3, 256, (n,), generator=_generator).tolist() for n in (41, 33))
ROWS = [(SHARED, ""), (SHARED, "sql"), (SHARED, "chat"), (SHARED, "code"), (OTHER, "sql"), (OTHER, "")]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer, logs):
    """(stack, peft's model with every adapter)."""
    root = tmp_path_factory.mktemp("lora-preemption")
    model_dir, paths = save_tiny_with_adapters(root, "llama3-rope", tokenizer, ADAPTERS)
    modules = [f"{name}={path}" for name, path in paths.items()]
    stack = start_stack(logs, "--model", str(model_dir), *FLAGS, "--lora-modules", *modules)
    yield stack, peft_model(model_dir, paths)
    assert stack.stop() == 0


def _reference(model, prompt: list[int], adapter: str) -> list[int]:
    if not adapter:
        with model.disable_adapter():
            return hf_greedy(model, prompt, NEW_TOKENS)
    model.set_adapter(adapter)
    return hf_greedy(model, prompt, NEW_TOKENS)


def test_preempted_adapter_requests_give_their_own_tokens(served):
    stack, reference = served
    before = preemptions(stack)
    with stack.client() as client, ThreadPoolExecutor(len(ROWS)) as pool:
        results = list(
            pool.map(
                lambda row: client.generate(
                    token_ids=row[0],
                    max_tokens=NEW_TOKENS,
                    temperature=0.0,
                    ignore_eos=True,
                    lora_adapter=row[1],
                ),
                ROWS,
            )
        )
    assert preemptions(stack) > before, "the pool is meant to run out"
    for (prompt, adapter), result in zip(ROWS, results, strict=True):
        assert result.token_ids == _reference(reference, prompt, adapter), adapter or "base"
    shared = {
        tuple(result.token_ids) for (prompt, _), result in zip(ROWS, results, strict=True) if prompt == SHARED
    }
    assert len(shared) == 4, "each adapter changes the shared prompt's tokens"
