"""Greedy outputs to compare: plain transformers' generate, compute's forward in this process over one
table, and the stack's for concurrent requests."""

import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import GenerationConfig

from common.sparse_settings import SparseMode
from compute_service.batch import ForwardBatch
from compute_service.model_loader import load
from compute_service.runner import Runner
from compute_service.validation import Limits
from tests.forward import forward_request

TIE = 1e-3  # float32 logprobs this close are a tie for greedy comparisons


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    return hf_greedy_gaps(model, ids, new_tokens)[0]


def hf_greedy_gaps(model, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens, and at each of them the gap between the top two log-probabilities;
    computed once per prompt and length for a model given to `keep_references`."""
    known = _REFERENCES.get(model)
    if known is None:
        return _hf_greedy_gaps(model, ids, new_tokens)
    if (key := (tuple(ids), new_tokens)) not in known:
        known[key] = _hf_greedy_gaps(model, ids, new_tokens)
    tokens, gaps = known[key]
    return list(tokens), list(gaps)


def keep_references(model):
    """`model`, its greedy references kept from now on while it lives: for a model no test changes after
    loading (no adapter switched, no weight set), which many modules ask for the same references."""
    _REFERENCES[model] = {}
    return model


_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hf_greedy_gaps(model, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    # eos_token_id=[]: never stop early, like ignore_eos (None would fall back to the model's EOS).
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), generation_config=config, output_logits=True, return_dict_in_generate=True
        )
    top2 = torch.cat(out.logits).float().log_softmax(-1).topk(2).values
    return out.sequences[0, len(ids) :].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def paged_greedy(
    model_dir, prompt: list[int], new_tokens: int, mode: SparseMode | None, block: int
) -> list[int]:
    """Compute's forward in this process over a pool of one table (every layer's blocks in it), block-sparse
    as `mode` says (None: dense), blocks of `block` tokens: the prompt in one step, then greedy decodes."""
    model, spec = load(str(model_dir), torch.float32, backend="cpu-native", sparse_attention=mode)
    config = model.config
    runner = Runner(model, plan=spec.plan)
    num_blocks = -(-(len(prompt) + new_tokens) // block)
    shape = (config.num_hidden_layers, 2, num_blocks, block, config.num_key_value_heads, config.head_dim)
    runner.attach(torch.zeros(shape))
    limits = Limits(config.vocab_size, spec.max_model_len, num_blocks, block)
    table, tokens, new = list(range(num_blocks)), list(prompt), list(prompt)
    while len(tokens) < len(prompt) + new_tokens:
        request = forward_request([new], [len(tokens) - len(new)], [table], block_size=block)
        new = [int(runner.logits(ForwardBatch.from_request(request, limits))[-1].argmax())]
        tokens += new
    return tokens[len(prompt) :]


def assert_greedy_equal(ours: list[int], reference: list[int], gaps: list[float], tie: float) -> None:
    """`ours` equals the reference, or first leaves it at a near-tie: where the reference's top two
    log-probabilities are within `tie` (0: never)."""
    assert len(ours) == len(reference)
    differ = [k for k, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b]
    if differ:
        at = differ[0]
        assert gaps[at] <= tie, f"diverged at token {at} ({ours[at]} != {reference[at]}), gap {gaps[at]}"


def concurrent_greedy(stack, prompts: list[list[int]], new_tokens: int):
    with stack.client() as client, ThreadPoolExecutor(len(prompts)) as pool:
        jobs = [
            pool.submit(client.generate, token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            for p in prompts
        ]
        return [job.result() for job in jobs]
