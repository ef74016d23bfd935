"""Multi-step paged generation with a tiny random Llama equals Hugging Face greedy generation."""

from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM

from compute_service import planning
from compute_service.batch import ForwardBatch
from compute_service.fused import fuse
from compute_service.linear import replace_linears
from compute_service.model_loader import register_attention
from compute_service.runner import Runner
from compute_service.validation import Limits
from tests.forward import forward_request as paged_forward_request
from tests.tiny_model import tiny_llama_config

BLOCK_SIZE, NUM_BLOCKS, DECODE_STEPS = 4, 32, 6
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13], [10, 20, 30]]


forward_request = partial(paged_forward_request, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module", params=["packed linear", "plain linear", "fused"])
def models(request):
    """The reference and the paged model, the latter's linears on the path the compute service uses by
    default (packed weights: native panels, or oneDNN where they do not build), or on nn.Linear's
    (--plain-linear), or rebuilt on fused layers (compute_service.fused) and packed, as the loader does."""
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(
        tiny_llama_config(initializer_range=0.3), attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    paged = AutoModelForCausalLM.from_config(
        tiny_llama_config(initializer_range=0.3),
        attn_implementation=register_attention("cpu"),
        dtype=torch.float32,
    ).eval()
    paged.load_state_dict(reference.state_dict())
    if request.param == "fused":
        fuse(paged)
    if request.param != "plain linear":
        linears = 4 if request.param == "fused" else 7
        linear = planning.dense_linears(planning.Flags(), "float32", planning.this_machine())
        assert replace_linears(paged, linear, linear) == linears * paged.config.num_hidden_layers + 1
    return reference, paged


def make_runner(model, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE) -> Runner:
    config = model.config
    runner = Runner(model)
    runner.attach(torch.zeros(config.num_hidden_layers, 2, num_blocks, block_size, 2, config.head_dim))
    return runner


def batch(model, request, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE) -> ForwardBatch:
    """The checked batch of a request on a pool of `num_blocks` blocks."""
    config = model.config
    limits = Limits(config.vocab_size, config.max_position_embeddings, num_blocks, block_size)
    return ForwardBatch.from_request(request, limits)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def paged_greedy(paged, prompts: list[list[int]], block_size: int, steps: int) -> tuple[list, list]:
    """Prefill of every prompt in one step, then `steps` batched decodes, on shuffled blocks: the tokens
    generated per sequence and the logits of every step."""
    per_seq = -(-(max(map(len, prompts)) + steps + 1) // block_size)
    num_blocks = per_seq * len(prompts)
    runner = make_runner(paged, num_blocks, block_size)
    blocks = torch.randperm(num_blocks).tolist()
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(len(prompts))]
    generated, step_logits = [[] for _ in prompts], []
    new, cached = prompts, [0] * len(prompts)
    for _ in range(1 + steps):
        step = batch(
            paged, paged_forward_request(new, cached, tables, block_size=block_size), num_blocks, block_size
        )
        logits = runner.logits(step)
        sampled = runner.forward(step)
        tokens = sampled.tokens
        assert torch.equal(tokens, logits.argmax(-1))
        torch.testing.assert_close(sampled.logprobs, logits.log_softmax(-1).max(-1).values)
        step_logits.append(logits)
        for seq, token in enumerate(tokens.tolist()):
            generated[seq].append(token)
        cached = [c + len(n) for c, n in zip(cached, new, strict=True)]
        new = [[token] for token in tokens.tolist()]
    return generated, step_logits


def assert_matches_hugging_face(reference, prompts, generated, step_logits) -> None:
    steps = len(step_logits)
    for seq, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, max_new_tokens=steps, do_sample=False)[0, len(prompt) :]
        assert len(set(expected.tolist())) > 1, "a degenerate model would not test attention"
        assert generated[seq][: len(expected)] == expected.tolist()
        expected_logits = hf_logits(reference, prompt + generated[seq])[len(prompt) - 1 : -1]
        ours = torch.stack([logits[seq] for logits in step_logits])
        torch.testing.assert_close(ours, expected_logits, atol=1e-4, rtol=1e-4)


def test_paged_greedy_generation_matches_hugging_face(models):
    reference, paged = models
    generated, step_logits = paged_greedy(paged, PROMPTS, BLOCK_SIZE, DECODE_STEPS)
    assert_matches_hugging_face(reference, PROMPTS, generated, step_logits)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_every_served_block_size_matches_hugging_face(models, block_size):
    reference, paged = models
    torch.manual_seed(block_size)
    # prompts shorter than, equal to and several times one block; decodes that cross a block boundary
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (5, block_size, 2 * block_size + 7, 300)]
    prompts[1] = prompts[1][: block_size - 2]
    generated, step_logits = paged_greedy(paged, prompts, block_size, 4)
    assert_matches_hugging_face(reference, prompts, generated, step_logits)


def test_chunked_prefill_samples_only_sequences_that_finished_their_prompt(models):
    reference, paged = models
    runner = make_runner(paged)
    long, short = PROMPTS[1], PROMPTS[0]
    tables = [[7, 3, 30], [12, 0]]
    # the long prompt's first chunk samples nothing; the short prompt completes and samples
    first = runner.logits(
        batch(paged, forward_request([long[:6], short], [0, 0], tables, sample=[False, True]))
    )
    assert first.shape == (1, paged.config.vocab_size)
    token = int(first[0].argmax())
    torch.testing.assert_close(first[0], hf_logits(reference, short)[-1], atol=1e-4, rtol=1e-4)
    second = runner.logits(batch(paged, forward_request([long[6:], [token]], [6, 5], tables)))
    torch.testing.assert_close(second[0], hf_logits(reference, long)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[1], hf_logits(reference, short + [token])[-1], atol=1e-4, rtol=1e-4)
