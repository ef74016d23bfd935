"""`pagedserve up --sparse-attention` with a tiny random Llama: a prompt within the budget gives transformers'
greedy tokens (dense), long prompts give the greedy tokens of compute's own block-sparse forward driven in
this process, concurrently (chunked prefill beside decodes) and again on a prefix hit (the summaries of the
cached blocks rebuilt from the pool); GetModelInfo reports the mode; another backend is refused at start-up
with one line."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.options import REFUSED
from compute_service.attention.sparse_settings import parse
from compute_service.batch import ForwardBatch
from compute_service.model_loader import load
from compute_service.runner import Runner
from compute_service.validation import Limits
from protos import compute_pb2
from tests.e2e.greedy import concurrent_greedy, hf_greedy
from tests.e2e.stack import start_stack
from tests.forward import forward_request
from tests.helpers import ROOT

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


def sparse_greedy(model_dir, prompt: list[int], new_tokens: int) -> list[int]:
    """Compute's block-sparse forward in this process: the prompt in one step, then greedy decodes."""
    model, spec = load(str(model_dir), torch.float32, backend="cpu-native", sparse_attention=parse(MODE))
    config = model.config
    runner = Runner(model, plan=spec.plan)
    num_blocks = -(-(len(prompt) + new_tokens) // BLOCK)
    runner.attach(torch.zeros(config.num_hidden_layers, 2, num_blocks, BLOCK, 2, config.head_dim))
    limits = Limits(config.vocab_size, spec.max_model_len, num_blocks, BLOCK)
    table, tokens, new = list(range(num_blocks)), list(prompt), list(prompt)
    while len(tokens) < len(prompt) + new_tokens:
        request = forward_request([new], [len(tokens) - len(new)], [table], block_size=BLOCK)
        new = [int(runner.logits(ForwardBatch.from_request(request, limits))[-1].argmax())]
        tokens += new
    return tokens[len(prompt) :]


def test_the_plan_reports_block_sparse_decode(stack):
    info = stack.compute().GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10)
    stages = {stage.stage: stage for stage in info.execution_plan.stages}
    assert stages["attention.decode"].implementation.startswith(f"cpu-native: block-sparse ({MODE}")
    assert stages["layers.decode"].implementation == "fused"


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
