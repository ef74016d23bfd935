"""Disaggregated prefill and decode behind `pagedserve up --prefill-computes 1`: a prefill compute and the
decode compute attached to the cache's one pool. Concurrent greedy requests (long prompts prefilled in chunks
on the prefill compute while the others decode, a short prompt that stays on the decode compute, a prefix
hit, two samples of one prompt) give transformers' greedy tokens; while the prefill compute, killed under a
decoding stream, is restarted by `up`, the compute serves alone (the stream decodes on, a new long prompt is
prefilled there), both with transformers' tokens, and prompts route to the new process once it is attached.
Roles `up` cannot serve are refused at start-up in one line."""

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cli.processes import children_of
from tests.e2e.greedy import TIE, assert_greedy_equal, hf_greedy_gaps
from tests.e2e.stack import start_stack
from tests.helpers import ROOT, log_events

pytestmark = pytest.mark.e2e

NEW_TOKENS = 8
THRESHOLD = 16
FLAGS = (
    *("--dtype", "float32", "--kv-blocks", "256", "--block-size", "8", "--max-batched-tokens", "24"),
    *("--prefill-computes", "1", "--threads", "1", "--prefill-threshold", str(THRESHOLD)),
    *("--log-format", "json", "--log-level", "debug"),
    # a restarted compute loads on two shared cores: the running stream waits for it
    *("--peer-restart-grace", "300"),
)
_generator = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(3, 256, (n,), generator=_generator).tolist() for n in (41, 30, 10)]


@pytest.fixture(scope="module")
def served(logs, model_dir):
    """(the stack, transformers' eager model)."""
    stack = start_stack(logs, "--model", str(model_dir), *FLAGS)
    reference = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    yield stack, reference.eval()
    assert stack.stop() == 0


def check(reference, prompt: list[int], tokens: list[int]) -> None:
    expected, gaps = hf_greedy_gaps(reference, prompt, len(tokens))
    assert_greedy_equal(tokens, expected, gaps, TIE)


def split_steps(stack) -> list[dict]:
    return [event for event in log_events(stack.proc.log_path) if event["event"] == "split_step"]


def test_prompts_on_the_prefill_compute_give_transformers_greedy_tokens(served):
    stack, reference = served
    shared = PROMPTS[0][:32] + PROMPTS[1][:20]  # a prefix hit of 32 tokens, 20 more to compute
    with stack.client() as client, ThreadPoolExecutor(4) as pool:
        greedy = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        jobs = [pool.submit(client.generate, token_ids=p, **greedy) for p in PROMPTS]
        for prompt, job in zip(PROMPTS, jobs, strict=True):
            check(reference, prompt, job.result().token_ids)
        hits = stack.stats().prefix_hit_tokens
        samples = pool.submit(client.generate_n, token_ids=shared, n=2, **greedy)
        for sample in samples.result():
            check(reference, shared, sample.token_ids)
    assert stack.stats().prefix_hit_tokens >= hits + 32
    steps = split_steps(stack)
    routed = {request for step in steps for request, _ in step["prefill"]}
    assert len(routed) == 3, "the two long prompts and the prefix hit ran on the prefill compute"
    assert all(chunk >= 1 for step in steps for _, chunk in step["prefill"])
    assert any(step["decodes"] for step in steps), "decodes ran beside a prefill"


def prefill_compute(stack) -> int:
    """The pid of the compute service on the prefill socket."""
    (pid,) = [
        pid
        for pid in children_of(stack.proc.pid)
        if {b"compute_service", str(stack.runtime_dir / "prefill.sock").encode()}
        <= set(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
    ]
    return pid


def test_the_compute_serves_alone_while_a_killed_prefill_compute_restarts(served):
    stack, reference = served
    stream_prompt, long_prompt = PROMPTS[2], PROMPTS[0][::-1]
    tokens, arrivals, started = [], [], threading.Event()

    def consume() -> None:
        with stack.client() as client:
            for chunk in client.stream(
                token_ids=stream_prompt, max_tokens=120, temperature=0.0, ignore_eos=True
            ):
                tokens.extend(chunk.token_ids)
                arrivals.append(time.time())
                if len(tokens) >= 10:
                    started.set()

    killed = prefill_compute(stack)
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(consume)
        assert started.wait(120)
        os.kill(killed, signal.SIGKILL)
        killed_at = time.time()
        with stack.client() as client:
            late = client.generate(
                token_ids=long_prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True
            )
        done.result(timeout=300)
    check(reference, stream_prompt, tokens)
    check(reference, long_prompt, late.token_ids)
    attached = wait_for_event(stack, "prefill_attached", 300)
    assert "prefill exited (signal SIGKILL)" in stack.proc.log_path.read_text()
    assert prefill_compute(stack) != killed
    events = list(log_events(stack.proc.log_path))
    assert [event for event in events if event["event"] == "prefill_detached"], "the engine saw it gone"
    assert not [event for event in events if event["event"] == "peer_lost"], "the engine never stopped"
    meanwhile = [at for at in arrivals if killed_at < at < wall_time(attached)]
    assert meanwhile, "the stream decoded while the prefill compute was down"
    with stack.client() as client:
        again = client.generate(
            token_ids=long_prompt[1:], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
            request_id="after-the-restart",
        )  # fmt: skip
    check(reference, long_prompt[1:], again.token_ids)
    routed = {request for step in split_steps(stack) for request, _ in step["prefill"]}
    assert "after-the-restart" in routed, "prompts route to the restarted prefill compute"


def wait_for_event(stack, name: str, timeout: float) -> dict:
    """The stack's first log event of that name, waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [event for event in log_events(stack.proc.log_path) if event["event"] == name]
        if found:
            return found[0]
        time.sleep(0.5)
    raise AssertionError(f"no {name} event in {timeout:.0f} s")


def wall_time(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (("--prefill-computes", "1", "--tensor-parallel-size", "2"), "a prefill compute serves one rank"),
        (("--decode-computes", "2"), "one host serves 1 decode compute and 0 or 1 prefill compute"),
    ],
)
def test_roles_up_cannot_serve_are_refused_in_one_line(tmp_path, flags, refusal):
    command = [sys.executable, "-m", "cli", "up", "--runtime-dir", str(tmp_path / "run"), *flags]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("pagedserve: ") and refusal in line
    assert not (tmp_path / "run").exists(), "nothing started"
