"""Models of several KV groups served by `pagedserve up`, from tiny random-weight checkpoints: Gemma 2 (one
full and one sliding layer: two groups of one layer) and Gemma 3 (five sliding layers to one full: six
groups of one layer) each keep a table per group over a pool of one layer slot. Concurrent greedy requests
(packed, their prompts longer than the sliding window and prefilled in chunks) give transformers' eager
greedy tokens through gRPC, the sliding groups' tables releasing the blocks before the window; a prompt
that extends an earlier one hits its prefix in every group and still gives transformers' tokens; a request
asking for block-sparse decode gets the tokens of the same sparse forward over one table; GetStats
and `pagedserve stats` report each group, every block comes back once the requests end, and compute
refuses a pool whose groups do not match its model. One stack at a time (memory)."""

import json
import subprocess
import sys

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from cli.scrape import scrape
from common.sparse_settings import parse
from gateway.handshake import handshake
from protos import common_pb2, compute_pb2
from tests.architectures import SLIDING_WINDOWS, save_tiny
from tests.e2e.greedy import concurrent_greedy, hf_greedy, paged_greedy
from tests.e2e.stack import start_stack
from tests.helpers import ROOT

pytestmark = pytest.mark.e2e

NAMES = ("gemma2", "gemma3_text")
NEW_TOKENS = 10
# A step's budget below every prompt: each is prefilled in chunks (beside the others' decodes).
FLAGS = ("--dtype", "float32", "--kv-blocks", "128", "--block-size", "4", "--max-batched-tokens", "24")
# Requests may ask for block-sparse decode (those that do not decode densely).
SPARSE = "sink=1,recent=2,topk=2"
SPARSE_FLAGS = ("--sparse-attention", f"allow,{SPARSE}")
SPARSE_ROWS = "pagedserve_forward_sparse_rows_total"
_generator = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(3, 256, (n,), generator=_generator).tolist() for n in (45, 29, 61)]


@pytest.fixture(scope="module", params=NAMES)
def served(request, tmp_path_factory, tokenizer, logs):
    """(name, its stack, transformers' eager model), one architecture at a time."""
    name = request.param
    path = save_tiny(name, tmp_path_factory.mktemp("kv_groups") / name)
    tokenizer.save_pretrained(path)
    stack = start_stack(logs, "--model", str(path), *FLAGS, *SPARSE_FLAGS)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    yield name, stack, reference.eval(), path
    assert stack.stop() == 0


def test_the_pool_keeps_a_table_per_kv_group(served):
    name, stack, _, _ = served
    windows = SLIDING_WINDOWS[name]
    groups = [(group.num_layers, group.window) for group in stack.stats().kv_groups]
    # full-attention groups first, then the sliding ones, each of one layer (the gcd of the patterns' counts)
    assert groups == sorted((1, window) for window in windows)
    info = stack.compute().GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10)
    assert tuple(info.sliding_windows) == windows
    assert stack.stats().sliding_window == 0, "no single window: each sliding group keeps its own"
    command = [sys.executable, "-m", "cli", "stats", "--cache-target", stack.cache_target]
    table = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    rows = dict(line.split(None, 1) for line in table.splitlines())
    assert rows["kv_groups.0"].strip() == "1 layers, full attention, 0 blocks held"
    assert rows[f"kv_groups.{len(groups) - 1}"].startswith(f"1 layers, a {max(windows)}-token window")
    as_json = json.loads(
        subprocess.run([*command, "--json"], cwd=ROOT, capture_output=True, check=True).stdout
    )
    assert [(g["num_layers"], g["window"]) for g in as_json["kv_groups"]] == groups


def test_concurrent_chunked_prompts_give_transformers_greedy_tokens(served):
    _, stack, reference, _ = served
    assert min(map(len, PROMPTS)) > 2 * max(SLIDING_WINDOWS["gemma3_text"] + SLIDING_WINDOWS["gemma2"])
    results = concurrent_greedy(stack, PROMPTS, NEW_TOKENS)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == hf_greedy(reference, prompt, NEW_TOKENS), f"prompt of {len(prompt)}"
    stats = stack.stats()
    # every table freed: only the null block (the sliding tables' released entries) stays used
    assert (stats.used_blocks, stats.num_sequences) == (1, 0)
    assert [group.held_blocks for group in stats.kv_groups] == [0] * len(stats.kv_groups)


def test_a_prompt_extending_an_earlier_one_hits_its_prefix_in_every_group(served):
    _, stack, reference, _ = served
    prompt = PROMPTS[0]
    with stack.client() as client:
        first = client.generate(token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        before = stack.stats().prefix_hit_tokens
        # a chat's next turn: the prompt, the answer and a few new tokens
        extended = [*prompt, *first.token_ids, *PROMPTS[1][:7]]
        result = client.generate(token_ids=extended, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert result.token_ids == hf_greedy(reference, extended, NEW_TOKENS)
    hit = stack.stats().prefix_hit_tokens - before
    # the first request wrote its prompt and all but its last token; whole blocks of 4 hit
    assert hit == (len(prompt) + NEW_TOKENS - 1) // 4 * 4, hit
    stats = stack.stats()
    assert (stats.used_blocks, stats.num_sequences) == (1, 0)


def test_one_request_at_a_time_gives_transformers_greedy_tokens(served):
    _, stack, reference, _ = served
    prompt = PROMPTS[2][:37]
    with stack.client() as client:
        result = client.generate(token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert result.token_ids == hf_greedy(reference, prompt, NEW_TOKENS)


def test_block_sparse_requests_over_the_groups_give_the_one_table_tokens(served):
    _, stack, _, path = served
    prompt = PROMPTS[2]
    # the full-attention layer attends 5 of the 16 blocks and more of each decode
    expected = paged_greedy(path, prompt, NEW_TOKENS, parse(SPARSE), 4)
    before = scrape(stack.metrics_url("compute")).get((SPARSE_ROWS, ()), 0.0)
    with stack.client() as client:
        result = client.generate(
            token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, sparse_attention=True
        )
    assert result.token_ids == expected
    selected = scrape(stack.metrics_url("compute"))[SPARSE_ROWS, ()] - before
    assert selected >= NEW_TOKENS - 1, "every decode after the first chose its blocks"


def test_compute_refuses_groups_that_do_not_match_its_model_and_keeps_its_pool(served):
    name, stack, reference, _ = served
    # the handshake again: the cache returns its pool, compute attaches it again
    _, handle = handshake(stack.cache(), stack.compute(), 4, 30.0, wait=False)
    assert len(handle.kv_groups) == len(SLIDING_WINDOWS[name]) and handle.shape[0] == 1
    other_window, merged = common_pb2.PoolHandle(), common_pb2.PoolHandle()
    other_window.CopyFrom(handle)
    other_window.kv_groups[-1].window += 1
    merged.CopyFrom(handle)
    del merged.kv_groups[1:]
    merged.kv_groups[0].layers[:] = range(len(SLIDING_WINDOWS[name]))
    # a sliding group keeping another window; one group of every layer over the pool's one slot
    for wrong, message in [(other_window, "group keeps a"), (merged, "layers for [1] layer slots")]:
        with pytest.raises(grpc.RpcError) as refused:
            stack.compute().AttachPool(wrong, timeout=30)
        details = refused.value.details()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the pool's KV groups do not match the model" in details and message in details
        assert "\n" not in details
    prompt = PROMPTS[1]
    with stack.client() as client:
        result = client.generate(token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert result.token_ids == hf_greedy(reference, prompt, NEW_TOKENS), "the attached pool stays"
