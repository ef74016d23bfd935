"""Runs of vLLM's benchmark client (`vllm bench serve`) against one OpenAI-compatible server: the command
line of each run, the client run by vLLM's interpreter (cli/bench/vllm_client_driver.py), and the figures
read from the result JSON the client returns.

Every run sends the client's random dataset (random token ids decoded to text with the model's tokenizer,
`input_len` tokens each), greedy (temperature 0, as every workload of the bench), with `ignore_eos`, to
/v1/completions, streamed, at most `concurrency` requests at a time, all sent at once (request rate inf).
Each run has a seed of its own, so that no run finds another's prompts in a prefix cache.
"""

import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cli.bench import binding, vllm_peer

DRIVER = Path(__file__).with_name("vllm_client_driver.py")
PROTOCOL = 1
ENDPOINT = "/v1/completions"
# The client's result keys behind each figure (its medians and 99th percentiles, in ms).
FIGURES = {
    "total_tokens_per_s": "total_token_throughput",
    "output_tokens_per_s": "output_throughput",
    "ttft_p50_ms": "median_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "itl_p50_ms": "median_itl_ms",
    "itl_p99_ms": "p99_itl_ms",
    "tpot_p50_ms": "median_tpot_ms",
    "duration_s": "duration",
}


@dataclass(frozen=True)
class Shape:
    """What every run sends: `prompts` requests of `input_len` prompt tokens and `output_len` new ones."""

    prompts: int = 32
    input_len: int = 256
    output_len: int = 64


def argv(
    base_url: str, model_dir: Path, served_name: str, concurrency: int, seed: int, shape: Shape
) -> list[str]:
    """The client's command line for one run: the model directory gives the tokenizer, `served_name` is the
    `model` of the requests; percentiles 50 and 99 of TTFT, time per output token and inter-token latency."""
    return [
        "--backend", "openai", "--base-url", base_url, "--endpoint", ENDPOINT,
        "--model", str(model_dir), "--tokenizer", str(model_dir), "--served-model-name", served_name,
        "--dataset-name", "random", "--random-input-len", str(shape.input_len),
        "--random-output-len", str(shape.output_len), "--num-prompts", str(shape.prompts),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
        # NOTE: the per-request lists (the driver keeps the first errors of them) come back only with this.
        "--save-detailed",
    ]  # fmt: skip


def figures(result: dict, shape: Shape) -> dict:
    """One run's figures from the client's result; ValueError unless every request completed with exactly
    its output_len tokens (ignore_eos)."""
    completed, failed = result.get("completed"), result.get("failed")
    if completed != shape.prompts or failed:
        errors = "".join(f": {error}" for error in result.get("first_errors", [])[:1])
        raise ValueError(
            f"the client completed {completed} of {shape.prompts} requests ({failed} failed){errors}"
        )
    expected = shape.prompts * shape.output_len
    if result.get("total_output_tokens") != expected:
        counted = result.get("total_output_tokens")
        raise ValueError(f"the client counted {counted} output tokens, not {expected}")
    missing = [key for key in FIGURES.values() if key not in result]
    if missing:
        raise ValueError(f"the client's result has no {', '.join(missing)}")
    return {ours: float(result[theirs]) for ours, theirs in FIGURES.items()}


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def run(python: str, runs: list[list[str]]) -> dict:
    """The client's answer to these runs, in order ("results"), and its version ("vllm_version");
    RuntimeError with its log's tail if it fails, ValueError if the answer is not protocol 1's."""
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-client-") as workdir:
        # NOTE: the client is no engine: it runs without vLLM's thread binding variables (binding.AUTO).
        request = {"protocol": PROTOCOL, "runs": runs}
        answer = vllm_peer.run_driver(python, request, Path(workdir), binding.AUTO, DRIVER)
    if answer.get("protocol") != PROTOCOL or len(answer.get("results", ())) != len(runs):
        raise ValueError(f"the vLLM client driver answered {str(answer)[:200]}")
    return answer
