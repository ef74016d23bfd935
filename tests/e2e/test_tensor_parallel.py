"""Tensor-parallel compute behind `pagedserve up`: --tensor-parallel-size 2 runs two compute rank processes
on gloo, each with half the heads and MLP columns and its own pool of half the KV heads in the cache's
segment, and concurrent greedy requests (prompts prefilled in chunks beside the others' decodes, a prefix
hit) give transformers' eager greedy tokens, for Llama, for Gemma 2 (alternating sliding windows, attention
and final soft-caps) and for OLMoE (every expert split by MLP columns, q and k norms across the heads). A
rank killed mid-stream takes its group down, `up` restarts it, and the stream goes on from the KV the cache
kept, with transformers' tokens. A model the ranks cannot split is refused at start-up in one line."""

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cli.processes import children_of, gone, services_of
from protos import compute_pb2
from tests.architectures import save_tiny
from tests.e2e.greedy import concurrent_greedy, hf_greedy
from tests.e2e.stack import start_stack
from tests.helpers import ROOT, log_events
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e

NEW_TOKENS = 8
FLAGS = (
    *("--dtype", "float32", "--kv-blocks", "128", "--block-size", "8", "--max-batched-tokens", "24"),
    *("--tensor-parallel-size", "2", "--threads", "1", "--log-format", "json"),
    # a restarted group loads two ranks on two shared cores: the running stream waits for it
    *("--peer-restart-grace", "300"),
)
_generator = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(3, 256, (n,), generator=_generator).tolist() for n in (41, 30, 19)]


@pytest.fixture(scope="module", params=["llama", "gemma2", "olmoe"])
def served(request, tmp_path_factory, tiny_model, tokenizer, logs):
    """(its stack, transformers' eager model), one architecture at a time."""
    path = tiny_model
    if request.param != "llama":
        path = save_tiny(request.param, tmp_path_factory.mktemp("tensor-parallel") / request.param)
        tokenizer.save_pretrained(path)
    stack = start_stack(logs, "--model", str(path), *FLAGS)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    yield stack, reference.eval()
    assert stack.stop() == 0


def test_two_ranks_give_transformers_greedy_tokens(served):
    stack, reference = served
    info = stack.compute().GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10)
    assert info.tensor_parallel_size == 2
    with stack.client() as client:
        assert client.info().tensor_parallel_size == 2
    results = concurrent_greedy(stack, PROMPTS, NEW_TOKENS)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == hf_greedy(reference, prompt, NEW_TOKENS), f"prompt of {len(prompt)}"
    # a prefix hit: both ranks read their own pool's blocks of the shared prefix
    prompt = PROMPTS[0][:32] + PROMPTS[1][:5]
    hits = stack.stats().prefix_hit_tokens
    with stack.client() as client:
        result = client.generate(token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert stack.stats().prefix_hit_tokens >= hits + 32
    assert result.token_ids == hf_greedy(reference, prompt, NEW_TOKENS)


def ranks_of(compute: int) -> list[int]:
    """The ranks > 0 that compute's rank 0 started."""
    return [
        pid for pid in children_of(compute) if b"--shard-rank" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


@pytest.mark.parametrize("served", ["llama"], indirect=True)
def test_a_rank_killed_mid_stream_restarts_the_group_and_the_stream_goes_on(served):
    stack, reference = served
    prompt, new_tokens = PROMPTS[1], 300
    expected = hf_greedy(reference, prompt, new_tokens)
    compute = services_of(stack.proc.pid)["compute"]
    (rank,) = ranks_of(compute)
    tokens, started = [], threading.Event()

    def consume() -> None:
        with stack.client() as client:
            for chunk in client.stream(
                token_ids=prompt, max_tokens=new_tokens, temperature=0.0, ignore_eos=True
            ):
                tokens.extend(chunk.token_ids)
                if len(tokens) >= 10:
                    started.set()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(consume)
        assert started.wait(60)
        os.kill(rank, signal.SIGKILL)
        running = not done.done()
        done.result(timeout=180)
    assert running, "the stream ran when the rank died"
    assert tokens == expected
    deadline = time.monotonic() + 10
    while not gone(compute) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(compute), "rank 0 went down with its group"
    log = stack.proc.log_path.read_text()
    assert "compute exited (exit code 1)" in log
    events = list(log_events(stack.proc.log_path))
    assert {"shard_rank_lost", "shard_group_broken"} & {event["event"] for event in events}
    (attached,) = [event for event in events if event["event"] == "attached" and event["again"]]
    assert attached["kept_running"] == 1, "the stream went on from the KV the cache kept"
    restarted = services_of(stack.proc.pid)["compute"]
    assert restarted != compute and len(ranks_of(restarted)) == 1, "a new group of two ranks serves"


def test_heads_the_ranks_cannot_split_are_refused_in_one_line(tmp_path):
    # one KV head shared by every query head (SmolLM2's 3 KV heads do not split over 2 ranks either)
    path = save_tiny_llama(tmp_path / "one-kv-head", num_key_value_heads=1)
    command = [sys.executable, "-m", "compute_service", "--model", str(path), "--port", "0", "--insecure"]
    done = subprocess.run(
        [*command, "--tensor-parallel-size", "2"], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 2, done.stderr[-2000:]
    refusals = [line for line in done.stderr.splitlines() if line.startswith("compute_service:")]
    assert len(refusals) == 1
    assert "the model's KV heads (1) do not split over 2 ranks" in refusals[0]
    assert "llama, mistral, qwen2, qwen3, gemma2, gemma3_text" in refusals[0]
