"""The vLLM peer's driver: runs a bench workload on vLLM's engine and times every token as it streams out.

It runs in vLLM's own interpreter (`python -P vllm_driver.py --output RESULT.json < WORKLOAD.json`), so it
imports nothing from pagedserve and nothing but the standard library at module level (vLLM's spawned
processes import this file again). Protocol version 1:

- input (stdin): {"protocol": 1, "model": DIR, "dtype": "float32", "max_model_len": N, "kv_memory_bytes": N,
  "kv_tokens": null or N, "repeat": R, "enforce_eager": false (optional), "load_format": "auto" (optional;
  "dummy": the model directory's config with random weights), "draft_tokens": 0 (optional; N: vLLM's prompt
  lookup, method "ngram", N tokens a step, the last 1 to 3 tokens looked up, as pagedserve's --draft-tokens),
  "requests": [{"prompt_ids": [...], "max_tokens": N, "arrival_s": S}, ...]}
- output (the file): {"protocol": 1, "vllm_version": V, "passes": [[{"sent": S, "token_times": [...],
  "token_ids": [...], "prompt_tokens": N, "cached_tokens": N, "completion_tokens": N}, ...], ...]}
  with one list per pass, its requests in input order, times in seconds from the pass's start.

Every request is greedy with ignore_eos and its exact max_tokens, sent at its arrival time by a task of its
own to vLLM's AsyncLLM (the engine behind vLLM's server), which streams each token as the engine makes it.
Each pass has a cache salt of its own, so a pass computes its prompts again (requests of one pass still share
prefixes), as the bench does for pagedserve.
"""

import argparse
import asyncio
import json
import sys
import time
import uuid

PROTOCOL = 1
REQUEST_FIELDS = ("prompt_ids", "max_tokens", "arrival_s")


def read_workload(text: str) -> dict:
    """The workload from its JSON text; ValueError naming what is wrong with it."""
    workload = json.loads(text)
    if workload.get("protocol") != PROTOCOL:
        raise ValueError(f"protocol {workload.get('protocol')!r}: this driver speaks protocol {PROTOCOL}")
    for key in ("model", "dtype", "max_model_len", "kv_memory_bytes", "repeat", "requests"):
        if key not in workload:
            raise ValueError(f"the workload has no {key!r}")
    if not workload["requests"]:
        raise ValueError("the workload has no requests")
    for i, request in enumerate(workload["requests"]):
        missing = [key for key in REQUEST_FIELDS if key not in request]
        if missing:
            raise ValueError(f"request {i} has no {', '.join(missing)}")
        if not request["prompt_ids"] or request["max_tokens"] < 1:
            raise ValueError(f"request {i} needs a prompt and max_tokens >= 1")
    return workload


class Trace:
    """One request as its client saw it: when it was sent, when each token came, how many were cached."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.token_times: list[float] = []
        self.token_ids: list[int] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def to_json(self, start: float) -> dict:
        return {
            "sent": self.sent - start,
            "token_times": [t - start for t in self.token_times],
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": len(self.token_ids),
        }


async def send(engine, request: dict, start: float, salt: str, make_params) -> Trace:
    """Sends one request at its arrival time and records each token as it streams out (delta outputs)."""
    await asyncio.sleep(max(0.0, start + request["arrival_s"] - time.perf_counter()))
    trace = Trace(time.perf_counter())
    prompt = {"prompt_token_ids": request["prompt_ids"], "cache_salt": salt}
    async for output in engine.generate(prompt, make_params(request["max_tokens"]), uuid.uuid4().hex):
        now = time.perf_counter()
        new = list(output.outputs[0].token_ids)
        trace.token_times.extend([now] * len(new))
        trace.token_ids.extend(new)
        if output.finished:
            trace.prompt_tokens = len(output.prompt_token_ids)
            trace.cached_tokens = output.num_cached_tokens or 0
    return trace


async def one_pass(engine, requests: list[dict], make_params) -> list[dict]:
    """All requests of one pass, each from its arrival time; their traces in input order."""
    salt = uuid.uuid4().hex
    start = time.perf_counter()
    traces = await asyncio.gather(*(send(engine, r, start, salt, make_params) for r in requests))
    return [trace.to_json(start) for trace in traces]


async def run_passes(engine, workload: dict, make_params) -> list[list[dict]]:
    """A short warm-up request, then `repeat` passes of the workload."""
    warm = {"prompt_ids": workload["requests"][0]["prompt_ids"][:16], "max_tokens": 4, "arrival_s": 0.0}
    await one_pass(engine, [warm], make_params)
    passes = []
    for i in range(workload["repeat"]):
        passes.append(await one_pass(engine, workload["requests"], make_params))
        print(f"vllm driver: pass {i + 1}/{workload['repeat']} done", file=sys.stderr, flush=True)
    return passes


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K and V of one token in every layer, from the model's config.json."""
    with open(f"{model_dir}/config.json") as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]


def engine_args(workload: dict) -> dict:
    """vLLM's engine arguments for the workload: same weights and dtype, prefix caching on, a KV cache of
    kv_memory_bytes, or with a KV budget in tokens the memory of that many tokens.

    NOTE: an explicit KV size also keeps vLLM's CPU worker from reserving a fixed share (92 %) of the host's
    memory, which a shared machine does not have free.
    """
    args = {
        "model": workload["model"],
        "dtype": workload["dtype"],
        "max_model_len": workload["max_model_len"],
        "kv_cache_memory_bytes": workload["kv_memory_bytes"],
        # NOTE: vLLM's own block size (its CPU attention wants multiples of 32; the bench's default is 16).
        "enable_prefix_caching": True,
        "disable_log_stats": True,
        # NOTE: eager skips vLLM's compile (~90 s at every start here: its AOT cache does not load on the CPU
        # in 0.32), for tests that check the protocol, not the speed.
        "enforce_eager": bool(workload.get("enforce_eager", False)),
        "load_format": workload.get("load_format", "auto"),
    }
    if workload.get("draft_tokens"):
        args["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": workload["draft_tokens"],
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    if workload.get("kv_tokens"):
        tokens_bytes = workload["kv_tokens"] * kv_bytes_per_token(workload["model"], workload["dtype"])
        args["kv_cache_memory_bytes"] = tokens_bytes
    return args


async def main_async(workload: dict) -> dict:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    def make_params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)  # fmt: skip

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(workload)))
    try:
        passes = await run_passes(engine, workload, make_params)
    finally:
        engine.shutdown()
    return {"protocol": PROTOCOL, "vllm_version": vllm.__version__, "passes": passes}


def main() -> int:
    parser = argparse.ArgumentParser(description="Run a pagedserve bench workload (JSON on stdin) on vLLM.")
    parser.add_argument("--output", required=True, help="where to write the per-request timings (JSON)")
    args = parser.parse_args()
    try:
        workload = read_workload(sys.stdin.read())
    except ValueError as error:
        print(f"vllm driver: bad workload: {error}", file=sys.stderr)
        return 2
    result = asyncio.run(main_async(workload))
    with open(args.output, "w") as out:
        json.dump(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
