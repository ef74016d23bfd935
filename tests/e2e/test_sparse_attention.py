"""`pagedserve up --sparse-attention` with a tiny random Llama: a prompt within the budget gives transformers'
greedy tokens (dense), long prompts give the greedy tokens of compute's own block-sparse forward driven in
this process, concurrently (chunked prefill beside decodes) and again on a prefix hit (the summaries of the
cached blocks rebuilt from the pool); a request asking for dense and one with settings of its own, in one
batch, each get their solo tokens, and compute counts only the sparse one's rows; bad settings, and asking
on a stack without it, are refused over gRPC, HTTP and the CLI, using no block; GetModelInfo reports the
mode; another backend is refused at start-up with one line."""

import json
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from cli.scrape import scrape
from common.options import REFUSED
from common.sparse_settings import SparseAttention, SparseMode, parse
from protos import compute_pb2
from sdk.client import GenerationError
from tests.e2e.greedy import concurrent_greedy, hf_greedy, paged_greedy
from tests.e2e.stack import start_stack
from tests.helpers import PAGEDSERVE, ROOT

pytestmark = pytest.mark.e2e

MODE, BLOCK, NEW_TOKENS = "sink=1,recent=2,topk=2", 4, 8
FLAGS = ("--dtype", "float32", "--kv-blocks", "256", "--block-size", str(BLOCK), "--max-batched-tokens", "32")
_generator = torch.Generator().manual_seed(5)
LONG = [torch.randint(3, 256, (n,), generator=_generator).tolist() for n in (70, 53)]
SHORT = LONG[0][:12]


@pytest.fixture(scope="module")
def stack(tiny_model, logs):
    stack = start_stack(logs, "--model", str(tiny_model), *FLAGS, "--sparse-attention", MODE)
    yield stack
    assert stack.stop() == 0


SPARSE_ROWS = "pagedserve_forward_sparse_rows_total"


@pytest.fixture(scope="module")
def dense_stack(tiny_model, logs):
    stack = start_stack(logs, "--model", str(tiny_model), *FLAGS)
    yield stack
    assert stack.stop() == 0


def sparse_greedy(model_dir, prompt: list[int], new_tokens: int, mode: SparseMode | None = None) -> list[int]:
    """The in-process greedy tokens, block-sparse as `mode` says (default MODE)."""
    return paged_greedy(model_dir, prompt, new_tokens, parse(MODE) if mode is None else mode, BLOCK)


def test_the_plan_reports_block_sparse_decode(stack):
    info = stack.compute().GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10)
    stages = {stage.stage: stage for stage in info.execution_plan.stages}
    decode = stages["attention.decode"].implementation
    assert decode.startswith(f"cpu-native: block-sparse for every decode by default ({MODE}")
    assert stages["layers.decode"].implementation == "native-stack"
    assert info.sparse_attention.enabled and info.sparse_attention.default_sparse
    assert (info.sparse_attention.settings.recent, info.sparse_attention.settings.topk) == (2, 2)


def test_long_prompts_give_the_sparse_forward_greedy_tokens_and_short_ones_dense(stack, tiny_model):
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    (short,) = concurrent_greedy(stack, [SHORT], 2)
    assert short.token_ids == hf_greedy(reference, SHORT, 2), "within the budget: dense"
    expected = [sparse_greedy(tiny_model, prompt, NEW_TOKENS) for prompt in LONG]
    results = concurrent_greedy(stack, LONG, NEW_TOKENS)
    assert [result.token_ids for result in results] == expected
    again = concurrent_greedy(stack, LONG[:1], NEW_TOKENS)[0]
    assert again.usage.cached_tokens > 0 and again.token_ids == expected[0]


def test_another_attention_backend_is_refused_at_start_up(tiny_model, tmp_path):
    refused = subprocess.run(
        [sys.executable, "-m", "compute_service", "--model", str(tiny_model), "--attention-backend", "cpu",
         "--sparse-attention", MODE, "--socket", str(tmp_path / "compute.sock"), "--log-level", "error"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == REFUSED, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert "--sparse-attention runs in the cpu-native attention backend, not in cpu" in line


def sparse_rows(stack) -> float:
    return scrape(stack.metrics_url("compute")).get((SPARSE_ROWS, ()), 0.0)


def test_dense_and_own_settings_requests_in_one_batch_get_their_solo_tokens(stack, tiny_model):
    own = {"sink": 0, "recent": 1, "topk": 3}
    expected_sparse = sparse_greedy(tiny_model, LONG[0], NEW_TOKENS, SparseMode(SparseAttention(**own)))
    expected_dense = sparse_greedy(tiny_model, LONG[1], NEW_TOKENS, SparseMode(default=False))
    assert expected_sparse != sparse_greedy(tiny_model, LONG[0], NEW_TOKENS), "the settings change the tokens"
    before = sparse_rows(stack)
    with stack.client() as client:
        dense = client.generate(
            token_ids=LONG[1], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, sparse_attention=False
        )
        assert dense.token_ids == expected_dense
        assert sparse_rows(stack) == before, "a dense request's decodes are counted as none"
        with ThreadPoolExecutor(2) as pool:
            jobs = [
                pool.submit(client.generate, token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
                            ignore_eos=True, sparse_attention=asked, cache_salt="batch")
                for prompt, asked in ((LONG[0], own), (LONG[1], False))
            ]  # fmt: skip
            sparse, dense = (job.result() for job in jobs)
    assert sparse.token_ids == expected_sparse and dense.token_ids == expected_dense
    assert sparse_rows(stack) - before >= NEW_TOKENS - 1, "the sparse request's decodes reach compute"


def test_the_cli_sends_a_requests_settings(stack):
    def generate(value: str) -> subprocess.CompletedProcess:
        # NOTE: a prompt of token ids inside the tiny model's vocabulary of 256
        return subprocess.run(
            [*PAGEDSERVE, "generate", "#$%", "--max-tokens", "2", "--temperature", "0",
             "--sparse-attention", value, "--target", stack.target],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    served = generate("sink=0,topk=3")
    assert served.returncode == 0, served.stderr
    refused = generate("topk=0")
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr, refused.stderr
    assert "recent and topk >= 1" in refused.stderr


@pytest.mark.parametrize(
    ("asked", "message"),
    [
        ({"topk": 0}, "sparse_attention sink=1,recent=2,topk=0: sink must be >= 0, recent and topk >= 1"),
        ({"sink": -1}, "sink must be >= 0"),
        ({"recent": 0, "topk": 4}, "recent and topk >= 1"),
    ],
)
def test_bad_settings_are_refused_over_grpc_and_http_using_no_block(stack, asked, message):
    with stack.client() as client, pytest.raises(GenerationError) as err:
        client.generate(token_ids=SHORT, max_tokens=2, sparse_attention=asked)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details
    code, body = post(stack, {"prompt": "hi", "max_tokens": 2, "sparse_attention": asked})
    assert code == 400 and message in body["error"]["message"]
    assert body["error"]["param"] == "sparse_attention"
    assert stack.stats().used_blocks == 0 and stack.stats().num_sequences == 0


def test_settings_with_enabled_false_and_a_wrong_type_are_refused(stack):
    code, body = post(stack, {"prompt": "hi", "sparse_attention": {"enabled": False, "topk": 4}})
    assert code == 400 and "sets topk with enabled false" in body["error"]["message"]
    code, body = post(stack, {"prompt": "hi", "sparse_attention": "yes"})
    assert code == 400 and "sparse_attention" in body["error"]["message"]


def test_asking_on_a_stack_without_it_says_how_to_enable_it(dense_stack):
    info = dense_stack.compute().GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10)
    assert not info.sparse_attention.enabled
    with dense_stack.client() as client:
        with pytest.raises(GenerationError) as err:
            client.generate(token_ids=SHORT, max_tokens=2, sparse_attention=True)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "start compute with --sparse-attention allow (or on)" in err.value.details
        dense = client.generate(token_ids=SHORT, max_tokens=2, temperature=0.0, sparse_attention=False)
    assert len(dense.token_ids) == 2, "asking for dense is served anywhere"
    code, body = post(dense_stack, {"prompt": "hi", "sparse_attention": {"topk": 4}})
    assert code == 400 and "--sparse-attention allow" in body["error"]["message"]
    assert dense_stack.stats().used_blocks == 0 and sparse_rows(dense_stack) == 0


def post(stack, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{stack.http_url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
