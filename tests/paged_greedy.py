"""Packed paged steps of a model as compute loads it (compute_service.model_loader.load), driven by hand, and
transformers' eager greedy tokens and log-probabilities to compare them with: a prompt alone, and steps that
hold a prompt cut in two chunks, a prompt beside that chunk, a prompt whose first blocks are another's (a
prefix hit) and decodes."""

import functools

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from compute_service.batch import ForwardBatch
from compute_service.model_loader import load
from compute_service.runner import Runner
from compute_service.validation import Limits
from tests.forward import forward_request

BLOCK_SIZE, NUM_BLOCKS, DECODES = 4, 64, 6
_generator = torch.Generator().manual_seed(7)
PROMPT_A = torch.randint(3, 256, (41,), generator=_generator).tolist()
PROMPT_B = torch.randint(3, 256, (33,), generator=_generator).tolist()
# C's first 16 tokens (4 whole blocks) are A's: C's table starts with A's blocks.
PROMPT_C = PROMPT_A[:16] + torch.randint(3, 256, (14,), generator=_generator).tolist()
ALONE = torch.randint(3, 256, (37,), generator=_generator).tolist()
FIRST_CHUNK, SHARED_BLOCKS = 20, 4


@functools.cache
def hf_greedy(path, prompt: tuple[int, ...], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' eager greedy tokens and their log-probabilities."""
    model = reference(path)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), generation_config=config, output_logits=True, return_dict_in_generate=True
        )
    logprobs = torch.cat(out.logits).float().log_softmax(-1).max(-1).values
    return out.sequences[0, len(prompt) :].tolist(), logprobs.tolist()


def assert_equal_greedy(path, prompt: list[int], ours: list[tuple[int, float]], what: str) -> None:
    tokens, logprobs = hf_greedy(path, tuple(prompt), len(ours))
    assert [token for token, _ in ours] == tokens, what
    torch.testing.assert_close([logprob for _, logprob in ours], logprobs, atol=1e-4, rtol=1e-4, msg=what)


@functools.cache
def reference(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


class Served:
    """A model as compute loads it, on a pool of NUM_BLOCKS blocks, stepped by hand."""

    def __init__(self, path, backend: str) -> None:
        self.model, self.spec = load(str(path), torch.float32, backend)
        config, spec = self.model.config, self.spec
        self.runner = Runner(self.model, spec.kv_scales)
        shape = (spec.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
        self.runner.attach(torch.zeros(shape))
        self.limits = Limits(config.vocab_size, spec.max_model_len, NUM_BLOCKS, BLOCK_SIZE)

    def step(self, new: list[list[int]], cached: list[int], tables: list[list[int]], sample: list[bool]):
        """The sampled (token, log-probability) of each sampling row."""
        request = forward_request(new, cached, tables, block_size=BLOCK_SIZE, sample=sample)
        sampled = self.runner.forward(ForwardBatch.from_request(request, self.limits))
        return list(zip(sampled.tokens.tolist(), sampled.logprobs.tolist(), strict=True))


def packed_greedy(served: Served) -> list[list[tuple[int, float]]]:
    """A (chunked), B and C (a prefix hit on A's first blocks) through packed steps; what they sampled."""
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
    a, b = blocks[:13], blocks[13:24]
    c = a[:SHARED_BLOCKS] + blocks[24:30]
    tables = [a, b, c]
    out = [[], [], []]
    # step 1: A's first chunk (nothing sampled) beside B's whole prompt
    (first,) = served.step([PROMPT_A[:FIRST_CHUNK], PROMPT_B], [0, 0], [a, b], [False, True])
    out[1].append(first)
    # step 2: A's second chunk, B's first decode, C's prompt after the 16 tokens A's blocks hold
    shared = SHARED_BLOCKS * BLOCK_SIZE
    new = [PROMPT_A[FIRST_CHUNK:], [first[0]], PROMPT_C[shared:]]
    sampled = served.step(new, [FIRST_CHUNK, len(PROMPT_B), shared], tables, [True] * 3)
    lengths = [len(PROMPT_A), len(PROMPT_B) + 1, len(PROMPT_C)]
    for _ in range(DECODES):
        for seq, pick in enumerate(sampled):
            out[seq].append(pick)
        sampled = served.step([[token] for token, _ in sampled], lengths, tables, [True] * 3)
        lengths = [n + 1 for n in lengths]
    return out


def alone_greedy(served: Served) -> list[tuple[int, float]]:
    table = list(range(NUM_BLOCKS - 12, NUM_BLOCKS))
    sampled = served.step([ALONE], [0], [table], [True])
    out = []
    for step in range(DECODES):
        out.append(sampled[0])
        sampled = served.step([[sampled[0][0]]], [len(ALONE) + step], [table], [True])
    return out
