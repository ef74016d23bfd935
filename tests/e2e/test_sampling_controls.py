"""Stop strings, min_tokens, logit_bias, penalties and logprobs through the public API on the real model."""

import subprocess

import pytest
import torch
from transformers import GenerationConfig

from tests.helpers import PAGEDSERVE

pytestmark = pytest.mark.e2e
PROMPT = "The three primary colours are"
GREEDY = dict(temperature=0.0, ignore_eos=True)


def spanning_stop(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one token's text and the start of the next's, first seen there;
    and the index of the token that completes it."""
    text = ""
    for i in range(1, len(ids)):
        left = tokenizer.decode(ids[:i])
        right = tokenizer.decode(ids[: i + 1])[len(left) :]
        stop = left[-2:] + right[:2]
        if len(left) >= 2 and len(right) >= 2 and stop.strip() == stop and stop not in left:
            return stop, i
        text = left
    raise AssertionError(f"no two neighbouring tokens with two characters each in {text!r}")


def test_a_stop_string_across_two_tokens_ends_the_text_right_before_it(stack_fp32, tokenizer):
    with stack_fp32.client() as client:
        full = client.generate(prompt=PROMPT, max_tokens=12, **GREEDY)
        stop, completing = spanning_stop(tokenizer, full.token_ids)
        chunks = list(client.stream(prompt=PROMPT, max_tokens=12, stop=[stop, "no such text"], **GREEDY))
        samples = client.generate_n(prompt=PROMPT, n=2, max_tokens=12, stop=stop, **GREEDY)
    text = "".join(c.text for c in chunks)
    assert text == full.text[: full.text.index(stop)]
    assert chunks[-1].finish_reason == "stop"
    assert [t for c in chunks for t in c.token_ids] == full.token_ids[: completing + 1]
    assert chunks[-1].usage.completion_tokens == completing + 1
    assert [(s.text, s.finish_reason) for s in samples] == [(text, "stop")] * 2
    assert stack_fp32.stats().used_blocks == 0


def test_min_tokens_holds_off_a_forced_eos(stack_fp32, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    forced = dict(prompt=PROMPT, max_tokens=20, temperature=0.0, logit_bias={eos: 100.0})
    with stack_fp32.client() as client:
        at_once = client.generate(**forced)
        held = client.generate(min_tokens=5, **forced)
    assert at_once.token_ids == [eos] and at_once.finish_reason == "stop"
    assert len(held.token_ids) == 6 and eos not in held.token_ids[:5]
    assert held.token_ids[-1] == eos and held.finish_reason == "stop"
    assert stack_fp32.stats().used_blocks == 0


def test_logit_bias_forces_a_token_in_greedy_and_sampled_decoding(stack_fp32, tokenizer):
    token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    with stack_fp32.client() as client:
        greedy = client.generate(prompt=PROMPT, max_tokens=4, logit_bias={token: 100.0}, **GREEDY)
        sampled = client.generate(
            prompt=PROMPT, max_tokens=4, temperature=1.0, seed=3, logit_bias={token: 100.0}
        )
        banned = client.generate(prompt=PROMPT, max_tokens=4, logit_bias={token: -100.0}, **GREEDY)
    assert greedy.token_ids == sampled.token_ids == [token] * 4
    assert token not in banned.token_ids


def test_greedy_logprobs_match_transformers(stack_fp32, tokenizer, hf_models):
    ids = tokenizer.encode(PROMPT)
    with stack_fp32.client() as client:
        result = client.generate(token_ids=ids, max_tokens=4, logprobs=5, **GREEDY)
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    with torch.inference_mode():
        logits = hf_models(torch.float32)(torch.tensor([ids + result.token_ids])).logits[0].float()
    expected = logits[len(ids) - 1 : -1].log_softmax(-1)
    for step, lp in enumerate(result.logprobs):
        top = expected[step].topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert lp.top[0][0] == lp.token_id, "greedy takes the most likely token"
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top.values, atol=2e-3, rtol=0)
        assert lp.logprob == pytest.approx(float(expected[step, lp.token_id]), abs=2e-3)


def test_repetition_penalty_matches_transformers(stack_fp32, tokenizer, hf_models):
    ids = tokenizer.encode("one two one two one two one two")
    with stack_fp32.client() as client:
        plain = client.generate(token_ids=ids, max_tokens=8, **GREEDY)
        penalized = client.generate(token_ids=ids, max_tokens=8, repetition_penalty=1.8, **GREEDY)
    config = GenerationConfig(
        max_new_tokens=8, do_sample=False, repetition_penalty=1.8, eos_token_id=[], pad_token_id=0
    )
    with torch.inference_mode():
        out = hf_models(torch.float32).generate(torch.tensor([ids]), generation_config=config)
    assert penalized.token_ids == out[0, len(ids) :].tolist()
    assert penalized.token_ids != plain.token_ids


def test_the_cli_takes_stop_strings_and_prints_logprobs(stack_fp32):
    out = subprocess.run(
        [*PAGEDSERVE, "generate", PROMPT, "--max-tokens", "12", "--temperature", "0", "--ignore-eos",
         "--stop", ",", "--logprobs", "2", "--target", stack_fp32.target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "," not in out.stdout and out.stdout.strip()
    rows = [line.split("\t") for line in out.stderr.splitlines() if line.count("\t") == 2]
    assert rows and all(float(lp) <= 0 and len(top.split()) == 2 for _, lp, top in rows)
    assert "[stop:" in out.stderr
