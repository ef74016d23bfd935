"""Prompt lookup through the whole stack (`pagedserve up --draft-tokens 4`): greedy requests, alone and side
by side, get the tokens of a stack without drafts (the session's float32 stack) while compute keeps drafts,
fewer steps than tokens; a stop id among kept drafts ends the request there; a seeded sampled request gets
its own tokens, no draft fed for it."""

import random

import pytest

from cli.scrape import scrape
from tests.e2e.greedy import concurrent_greedy
from tests.e2e.stack import start_stack

pytestmark = pytest.mark.e2e

NEW_TOKENS = 48
DRAFTED, ACCEPTED = "pagedserve_draft_tokens_total", "pagedserve_draft_tokens_accepted_total"


@pytest.fixture(scope="module")
def drafting(model_dir, logs):
    stack = start_stack(logs, "--dtype", "float32", "--kv-blocks", "512", "--draft-tokens", "4")
    yield stack
    assert stack.stop() == 0


def _drafts(stack) -> tuple[float, float]:
    samples = scrape(stack.metrics_url("compute"))
    return samples[DRAFTED, ()], samples[ACCEPTED, ()]


def _prompts(tokenizer) -> list[list[int]]:
    """Random ids, as the bench sends (the model soon repeats itself after them), and a counting text."""
    rng = random.Random(5)
    text = tokenizer.encode("Count with me: one, two, three, four, five, six, seven, eight, nine, ten,")
    return [[rng.randrange(100, 40_000) for _ in range(n)] for n in (64, 200)] + [text]


def test_greedy_tokens_are_those_without_drafts_in_fewer_steps(drafting, stack_fp32, tokenizer):
    prompts = _prompts(tokenizer)
    expected = [r.token_ids for r in concurrent_greedy(stack_fp32, prompts, NEW_TOKENS)]
    drafted, accepted = _drafts(drafting)
    with drafting.client() as client:
        alone = client.generate(token_ids=prompts[0], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert alone.token_ids == expected[0]
    assert [r.token_ids for r in concurrent_greedy(drafting, prompts, NEW_TOKENS)] == expected
    now_drafted, now_accepted = _drafts(drafting)
    assert now_drafted > drafted and now_accepted > accepted, "drafts fed, and some kept"
    assert now_accepted - accepted > NEW_TOKENS // 2, "the repeating outputs keep many drafts"


def test_a_stop_id_among_kept_drafts_ends_the_request_there(drafting, stack_fp32, tokenizer):
    prompt = _prompts(tokenizer)[1]
    with stack_fp32.client() as client:
        full = client.generate(token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # a token that recurs late in the output: the first time it comes, the request ends
    stop_id = full.token_ids[-1]
    cut = full.token_ids[: full.token_ids.index(stop_id) + 1]
    with drafting.client() as client:
        greedy = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        result = client.generate(token_ids=prompt, stop_token_ids=[stop_id], **greedy)
    assert result.token_ids == cut and result.finish_reason == "stop"


def test_a_seeded_sampled_request_feeds_no_drafts(drafting, stack_fp32, tokenizer):
    prompt = _prompts(tokenizer)[0]
    sampling = dict(max_tokens=NEW_TOKENS, temperature=0.8, seed=7, ignore_eos=True)
    with stack_fp32.client() as client:
        expected = client.generate(token_ids=prompt, **sampling).token_ids
    drafted = _drafts(drafting)[0]
    with drafting.client() as client:
        assert client.generate(token_ids=prompt, **sampling).token_ids == expected
    assert _drafts(drafting)[0] == drafted
