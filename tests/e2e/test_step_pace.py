"""--decode-step-target-ms and --pace-streams through `pagedserve up`: bad values are refused at start-up; a
paced stack cuts the prompt chunks that run beside decodes to what its target allows and gives the greedy
tokens of a stack without a target."""

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.greedy import TIE
from tests.e2e.stack import stacks_side_by_side
from tests.helpers import PAGEDSERVE, ROOT, log_events

pytestmark = pytest.mark.e2e

FLAGS = ("--dtype", "float32", "--kv-blocks", "256", "--log-format", "json", "--log-level", "debug")


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "inf", ""])
def test_a_bad_target_is_refused_at_start_up_in_one_line(value):
    out = subprocess.run(
        [*PAGEDSERVE, "up", f"--decode-step-target-ms={value}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"pagedserve up: error: argument --decode-step-target-ms: {value!r}: give milliseconds, a number "
        ">= 0 (0: off)"
    )
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "many"])
def test_a_bad_pace_streams_is_refused_at_start_up_in_one_line(value):
    out = subprocess.run(
        [*PAGEDSERVE, "up", f"--pace-streams={value}"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"pagedserve up: error: argument --pace-streams: {value!r}: give a stream count, an integer >= 1"
    )
    assert "Traceback" not in out.stderr


def mixed_load(stack, vocab: int) -> list:
    """Four short prompts decoding 300 tokens (still decoding while the rest is prefilled); once they
    stream, three 400-token prompts arrive. Each greedy, with the top two logprobs."""
    short = [[(17 * i + 5 * k) % (vocab - 3) + 3 for k in range(8)] for i in range(4)]
    long = [[(31 * i + 7 * k) % (vocab - 3) + 3 for k in range(400)] for i in range(3)]

    def generate(client, prompt, max_tokens):
        return client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                               logprobs=2)  # fmt: skip

    with stack.client() as client, ThreadPoolExecutor(7) as pool:
        first = [pool.submit(generate, client, p, 300) for p in short]
        time.sleep(0.2)
        later = [pool.submit(generate, client, p, 8) for p in long]
        return [job.result() for job in (*first, *later)]


def prompt_tokens_beside_decodes(log_path) -> list[int]:
    """Per step that ran decodes (chunks of one token) and a prompt chunk: its prompt tokens."""
    steps = [[row[2] for row in e["chunks"]] for e in log_events(log_path) if e["event"] == "step"]
    return [sum(n for n in chunks if n > 1) for chunks in steps if 1 in chunks and max(chunks) > 1]


def test_a_paced_stack_cuts_chunks_beside_decodes_and_gives_the_same_greedy_tokens(tiny_model, logs):
    # NOTE: a 0.5 ms target is below any step through the stack: once the fit is warm every prompt chunk
    # beside decodes is the minimum, 64 tokens.
    flags = ("--model", str(tiny_model), *FLAGS)
    with stacks_side_by_side(logs, flags, "--decode-step-target-ms", ["0", "0.5"]) as stacks:
        results = {value: mixed_load(stack, 256) for value, stack in stacks.items()}
        mixed = {value: prompt_tokens_beside_decodes(stack.proc.log_path) for value, stack in stacks.items()}
    assert max(mixed["0"]) > 64, f"without a target the token cap sizes the chunks: {mixed['0']}"
    assert mixed["0.5"] and max(mixed["0.5"][8:]) <= 64, f"the pace cuts them: {mixed['0.5']}"
    for i, (ours, reference) in enumerate(zip(results["0.5"], results["0"], strict=True)):
        assert len(ours.token_ids) == len(reference.token_ids)
        pairs = zip(ours.token_ids, reference.token_ids, strict=True)
        differ = [k for k, (a, b) in enumerate(pairs) if a != b]
        if differ:
            (first, second), at = reference.logprobs[differ[0]].top, differ[0]
            assert first[1] - second[1] < TIE, f"request {i} diverged at token {at} without a near-tie"
