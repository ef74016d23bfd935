"""Architectures other than Llama served by `pagedserve up` from tiny random-weight checkpoints (Hugging Face
directories, and a GGUF): concurrent greedy requests (packed, their prompts longer than every sliding window
and prefilled in chunks) and a prefix hit give transformers' eager greedy tokens through gRPC; chat messages
take the GGUF's chat template and EOS; GetModelInfo reports each layer's window, and a model sliding one
window on every layer has the cache's tables release the blocks before it; an encoder-only checkpoint
stops `up` at start-up with one line. One stack at a time (memory)."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BertConfig

from common.model_files import local_copy
from protos import compute_pb2
from tests.architectures import FAST_PATH, SLIDING_WINDOWS, UNFUSED, save_tiny
from tests.e2e.greedy import concurrent_greedy, hf_greedy
from tests.e2e.stack import start_stack
from tests.gguf_model import save_tiny_qwen2_gguf
from tests.helpers import ROOT

pytestmark = pytest.mark.e2e

# Mistral: a window on every layer, on the fused layers and the native decode stack; Gemma 2: alternating
# windows, attention and final soft-caps; Gemma 3: five local layers to one global, two rope bases; Qwen2
# (QKV biases, a tied head) and Qwen3 (QK-norm), a full and a sliding layer each, on the fused layers and
# the native decode stack; Qwen2 from a GGUF file: QKV biases, its own tokenizer and chat template.
GGUF = "qwen2-gguf"
NAMES = ("mistral", "gemma2", "gemma3_text", "qwen2", "qwen3", GGUF)
NEW_TOKENS = 8
# A step's budget below every prompt: each is prefilled in chunks (beside the others' decodes).
FLAGS = ("--dtype", "float32", "--kv-blocks", "128", "--block-size", "8", "--max-batched-tokens", "24")
_generator = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(3, 256, (n,), generator=_generator).tolist() for n in (41, 33, 57)]


@pytest.fixture(scope="module", params=NAMES)
def served(request, tmp_path_factory, tokenizer, logs):
    """(name, model directory, its stack, transformers' eager model), one architecture at a time."""
    name, root = request.param, tmp_path_factory.mktemp("architectures")
    if name == GGUF:
        path = root / "tiny-qwen2.gguf"
        save_tiny_qwen2_gguf(path)
        reference_dir = local_copy(str(path)).path
    else:
        path = reference_dir = save_tiny(name, root / name)
        tokenizer.save_pretrained(path)
    stack = start_stack(logs, "--model", str(path), *FLAGS)
    reference = AutoModelForCausalLM.from_pretrained(
        reference_dir, dtype=torch.float32, attn_implementation="eager"
    )
    yield name, path, stack, reference.eval()
    assert stack.stop() == 0


def test_concurrent_chunked_prompts_give_transformers_greedy_tokens(served):
    _, _, stack, reference = served
    results = concurrent_greedy(stack, PROMPTS, NEW_TOKENS)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == hf_greedy(reference, prompt, NEW_TOKENS), f"prompt of {len(prompt)}"
        assert result.usage.completion_tokens == NEW_TOKENS


def test_a_prefix_hit_gives_transformers_greedy_tokens(served):
    _, _, stack, reference = served
    prompt = PROMPTS[2][:32] + PROMPTS[0][:12]
    with stack.client() as client:
        client.generate(token_ids=PROMPTS[2], max_tokens=1, temperature=0.0, ignore_eos=True)
        hits = stack.stats().prefix_hit_tokens
        result = client.generate(token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert stack.stats().prefix_hit_tokens >= hits + 32, (
        "the shared 32 tokens (4 blocks) are read, not computed"
    )
    assert result.token_ids == hf_greedy(reference, prompt, NEW_TOKENS)


def test_model_info_reports_each_layers_window(served):
    name, _, stack, reference = served
    info = stack.compute().GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=10)
    assert info.execution_plan.architecture == reference.config.model_type
    windows = (0,) * reference.config.num_hidden_layers if name == GGUF else SLIDING_WINDOWS[name]
    assert tuple(info.sliding_windows) == windows
    # one window on every layer: the cache's tables keep only it (Mistral); else every block
    assert stack.stats().sliding_window == (windows[0] if len(set(windows)) == 1 else 0)
    plan = info.execution_plan
    stages = {stage.stage: stage.implementation for stage in plan.stages}
    assert (stages["layers"], stages["layers.decode"]) == FAST_PATH.get(plan.architecture, UNFUSED)


@pytest.mark.parametrize("served", [GGUF], indirect=True)
def test_chat_messages_take_the_gguf_chat_template_and_eos(served):
    _, path, stack, reference = served
    gguf_tokenizer = AutoTokenizer.from_pretrained(local_copy(str(path)).path)
    messages = [{"role": "user", "content": "Name three rivers."}]
    text = gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = gguf_tokenizer.encode(text, add_special_tokens=False)
    eos = gguf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with stack.client() as client:
        assert eos in client.info().eos_token_ids, "the GGUF's EOS"
        result = client.generate(messages=messages, max_tokens=NEW_TOKENS, temperature=0.0)
    assert result.usage.prompt_tokens == len(ids), "rendered with the GGUF's chat template"
    expected = hf_greedy(reference, ids, NEW_TOKENS)
    assert result.token_ids == expected[: expected.index(eos) + 1 if eos in expected else None]


def test_up_stops_at_once_on_an_encoder_only_checkpoint(tmp_path):
    BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    command = [sys.executable, "-m", "cli", "up", "--model", str(tmp_path), "--port", "0", "--http-port", "0"]
    command += ["--runtime-dir", str(tmp_path / "run")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1
    refusals = [line for line in done.stderr.splitlines() if line.startswith("compute_service:")]
    assert len(refusals) == 1 and "model_type 'bert' is an encoder-only model" in refusals[0]
    assert "compute refused its settings or model (exit code 2); stopping the stack" in done.stderr
    assert "compute restarted" not in done.stderr
