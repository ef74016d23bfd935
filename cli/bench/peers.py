"""The peers a user would otherwise pick, on the same prompts and weights, in the bench process."""

import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from cli.bench.driver import percentile
from cli.bench.workloads import Workload
from common.model_files import local_copy


class _TokenClock(BaseStreamer):
    """Records when each generated token comes out of `generate` (batch of one)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def load(model: str, dtype: str):
    return AutoModelForCausalLM.from_pretrained(local_copy(model).path, dtype=getattr(torch, dtype)).eval()


def _config(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)


def generate_batch(model, workload: Workload) -> dict:
    """transformers' continuous batching (paged cache, its own scheduler), all requests at once."""
    prompts = [r.prompt_ids for r in workload.requests]
    max_new = max(r.max_tokens for r in workload.requests)
    start = time.perf_counter()
    with torch.inference_mode():
        outputs = model.generate_batch(prompts, generation_config=_config(max_new), progress_bar=False)
    wall = time.perf_counter() - start
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    prompt = sum(map(len, prompts))
    return {
        "wall_s": wall,
        "tokens_per_s": (prompt + generated) / wall,
        "generated_tokens_per_s": generated / wall,
    }


def generate_padded(model, workload: Workload) -> dict:
    """Plain `generate` on one left-padded batch; for one request, per-token timings too."""
    prompts = [r.prompt_ids for r in workload.requests]
    max_new = max(r.max_tokens for r in workload.requests)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _TokenClock() if len(prompts) == 1 else None
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, generation_config=_config(max_new), streamer=clock)
    wall = time.perf_counter() - start
    generated = max_new * len(prompts)
    result = {
        "wall_s": wall,
        "tokens_per_s": (sum(map(len, prompts)) + generated) / wall,
        "generated_tokens_per_s": generated / wall,
    }
    if clock is not None:
        gaps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
        result["ttft_p50_ms"] = 1e3 * (clock.times[0] - start)
        result["itl_p50_ms"] = 1e3 * percentile(gaps, 50)
        result["itl_p99_ms"] = 1e3 * percentile(gaps, 99)
    return result
