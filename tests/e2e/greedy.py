"""Greedy outputs to compare: plain transformers' generate, and the stack's for concurrent requests."""

from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import GenerationConfig


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    # eos_token_id=[]: never stop early, like ignore_eos (None would fall back to the model's EOS).
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), generation_config=config)
    return out[0, len(ids) :].tolist()


def concurrent_greedy(stack, prompts: list[list[int]], new_tokens: int):
    with stack.client() as client, ThreadPoolExecutor(len(prompts)) as pool:
        jobs = [
            pool.submit(client.generate, token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            for p in prompts
        ]
        return [job.result() for job in jobs]
