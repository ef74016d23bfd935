"""A bench workload sent to llama.cpp's server (`llama-server`) through its OpenAI-compatible completions
endpoint, streamed, each token timed as it arrives.

Prompts go as token ids (`"prompt": [ids]`), so llama.cpp computes exactly the tokens the other engines do.
Every request is greedy (temperature 0) with `ignore_eos` and its exact `max_tokens`. A streamed chunk may
carry no token (the stream's last, with the usage) or more than one (llama.cpp holds back a token that ends
inside a UTF-8 character and sends it with the next): with `timings_per_token` every chunk has the number of
tokens generated so far (`timings.predicted_n`), which the clock follows. The cached prompt tokens come from
the usage (`prompt_tokens_details.cached_tokens`), else the timings' `cache_n`.
"""

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from cli.bench.driver import Trace
from cli.bench.workloads import BenchRequest, Workload

# A request that streams nothing for this long is stuck.
READ_TIMEOUT_S = 600.0


class ServerError(RuntimeError):
    """llama-server refused a request or broke off its stream."""


def body(request: BenchRequest) -> dict:
    """The completions request of one bench request."""
    return {
        "prompt": request.prompt_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "timings_per_token": True,
        "cache_prompt": True,
    }


def _events(reply):
    """The JSON payloads of a server-sent event stream, up to `[DONE]`."""
    for raw in reply:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def stream(base_url: str, request: BenchRequest, start: float, on_token=lambda n: None) -> Trace:
    """Sends the request at its arrival time (seconds after `start`, a perf_counter) and times each token;
    ServerError with the server's message if it refuses or breaks off."""
    time.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    http = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body(request)).encode(),
        headers={"Content-Type": "application/json"},
    )
    trace = Trace(sent=time.perf_counter())
    try:
        with urllib.request.urlopen(http, timeout=READ_TIMEOUT_S) as reply:
            for chunk in _events(reply):
                _take(trace, chunk, time.perf_counter(), on_token)
    except urllib.error.HTTPError as error:
        message = error.read().decode(errors="replace")
        raise ServerError(f"llama-server answered {error.code}: {message}") from None
    return trace


def _take(trace: Trace, chunk: dict, now: float, on_token) -> None:
    if "error" in chunk:
        raise ServerError(f"llama-server broke off the stream: {chunk['error']}")
    timings = chunk.get("timings")
    if timings is None or "predicted_n" not in timings:
        raise ServerError("llama-server sent a chunk without timings.predicted_n (timings_per_token ignored)")
    new = timings["predicted_n"] - len(trace.token_times)
    trace.token_times.extend([now] * new)
    on_token(new)
    usage = chunk.get("usage")
    if usage:
        trace.prompt_tokens = usage["prompt_tokens"]
        trace.completion_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        trace.cached_tokens = details.get("cached_tokens", timings.get("cache_n", 0))


def one_pass(base_url: str, workload: Workload, on_token=lambda n: None) -> list[Trace]:
    """Every request of the workload, each from its arrival time on a thread of its own; their traces in
    request order, times in perf_counter seconds."""
    with ThreadPoolExecutor(len(workload.requests)) as pool:
        start = time.perf_counter()
        return list(pool.map(lambda r: stream(base_url, r, start, on_token), workload.requests))


def warm_up(base_url: str, workload: Workload) -> None:
    """A short request whose prompt starts with no request's first token, so no request finds it cached."""
    firsts = {r.prompt_ids[0] for r in workload.requests}
    token = next(t for t in range(100, 100 + len(firsts) + 1) if t not in firsts)
    stream(base_url, BenchRequest([token] * 16, 4), time.perf_counter())
