"""Greedy outputs to compare: plain transformers' generate, and the stack's for concurrent requests."""

from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import GenerationConfig

TIE = 1e-3  # float32 logprobs this close are a tie for greedy comparisons


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    return hf_greedy_gaps(model, ids, new_tokens)[0]


def hf_greedy_gaps(model, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens, and at each of them the gap between the top two log-probabilities."""
    # eos_token_id=[]: never stop early, like ignore_eos (None would fall back to the model's EOS).
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), generation_config=config, output_logits=True, return_dict_in_generate=True
        )
    top2 = torch.cat(out.logits).float().log_softmax(-1).topk(2).values
    return out.sequences[0, len(ids) :].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


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
