"""LoRA adapters in compute (compute_service.lora): three PEFT adapters of different ranks and targets, one
rsLoRA, run in one packed step beside a base row, prefill then decodes, give peft's PeftModel greedy tokens
on the fused Llama and Qwen2 (QKV biases) layers, with the native decode stack planned, and on Gemma 2's
(soft-capping, sliding windows) and Phi-3's (fused QKV and gate/up targets) transformers layers; adapters
that do not fit are refused at load and steps naming no resident adapter are refused, nothing changed;
compute refuses an adapter at start with one line, before the model loads, from its config and header."""

import re
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import InvalidArgument
from common.options import REFUSED
from compute_service.batch import ForwardBatch
from compute_service.lora.adapters import Adapters, check_flags
from compute_service.lora.layers import LoraLinear, StepRows, set_rows
from compute_service.lora.peft_files import WEIGHTS, AdapterError
from compute_service.model_loader import load
from compute_service.runner import Runner
from compute_service.speculation import step_batch
from compute_service.validation import Limits
from tests.architectures import save_tiny
from tests.e2e.greedy import hf_greedy
from tests.forward import forward_request
from tests.lora_adapters import LLAMA_ATTENTION, LLAMA_MLP, merged_hidden, peft_model, save_adapter
from tests.tiny_model import save_tiny_llama, tiny_llama_config

BLOCK, BLOCKS_PER_SEQ, NEW_TOKENS = 8, 8, 5
# name -> (rank, targets, rsLoRA) per architecture
ADAPTERS = {
    "llama3-rope": {
        "a": (4, ["q_proj", "v_proj"], False),
        "b": (8, LLAMA_ATTENTION + LLAMA_MLP, True),
        "c": (2, ["o_proj", "gate_proj", "down_proj"], False),
    },
    "qwen2": {
        "a": (4, ["q_proj", "k_proj", "v_proj"], False),
        "b": (8, LLAMA_ATTENTION + LLAMA_MLP, True),
        "c": (2, ["o_proj", "up_proj", "down_proj"], False),
    },
    "gemma2": {
        "a": (4, ["q_proj", "o_proj"], False),
        "b": (8, LLAMA_ATTENTION + LLAMA_MLP, True),
        "c": (2, ["v_proj", "gate_proj", "down_proj"], False),
    },
    "phi3": {
        "a": (4, ["qkv_proj", "o_proj"], False),
        "b": (8, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], True),
        "c": (2, ["down_proj"], False),
    },
}
_generator = torch.Generator().manual_seed(3)
PROMPTS = [torch.randint(3, 256, (n,), generator=_generator).tolist() for n in (13, 9, 17, 11)]


@pytest.fixture(scope="module", params=list(ADAPTERS))
def served(request, tmp_path_factory):
    """(model directory, adapter directories, the runner with them resident, the limits)."""
    root = tmp_path_factory.mktemp(request.param)
    model_dir = save_tiny(request.param, root / "model")
    paths = {
        name: save_adapter(model_dir, root / name, rank, targets, seed=i, rslora=rslora)
        for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS[request.param].items())
    }
    model, spec = load(str(model_dir), torch.float32, backend="cpu-native")
    adapters = Adapters.on(model, max_loras=4, max_rank=8)
    for name, path in paths.items():
        adapters.load(name, str(path))
    runner = Runner(model, plan=spec.plan, adapters=adapters)
    config = model.config
    blocks = BLOCKS_PER_SEQ * len(PROMPTS)
    runner.attach(torch.zeros(config.num_hidden_layers, 2, blocks, BLOCK, config.num_key_value_heads, 16))
    return model_dir, paths, runner, Limits(config.vocab_size, spec.max_model_len, blocks, BLOCK)


def _step(runner: Runner, limits: Limits, new, computed, lora_ids) -> list[int]:
    tables = [list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(new))]
    request = forward_request(new, computed, tables, block_size=BLOCK)
    request.lora_ids.extend(lora_ids)
    return runner.logits(ForwardBatch.from_request(request, limits)).argmax(-1).tolist()


def test_one_step_mixes_base_and_three_adapters_as_peft(served):
    model_dir, paths, runner, limits = served
    ids = [0, *(runner.adapters.by_name[name].id for name in paths)]
    new, computed, outputs = [list(p) for p in PROMPTS], [0] * len(PROMPTS), [[] for _ in PROMPTS]
    for _ in range(NEW_TOKENS):
        tokens = _step(runner, limits, new, computed, ids)
        for row, token in enumerate(tokens):
            computed[row] += len(new[row])
            new[row] = [token]
            outputs[row].append(token)
    reference = peft_model(model_dir, paths)
    with reference.disable_adapter():
        assert outputs[0] == hf_greedy(reference, PROMPTS[0], NEW_TOKENS)
    for row, name in enumerate(paths, start=1):
        reference.set_adapter(name)
        assert outputs[row] == hf_greedy(reference, PROMPTS[row], NEW_TOKENS), name
    assert len({tuple(out) for out in outputs}) == len(outputs), "each adapter changes the tokens"


def test_pooled_rows_of_each_adapter_are_the_peft_merged_models_hidden_states(served):
    """Embedding rows (mean pooling: every token's hidden state counts) of the base and three adapters in
    one packed step, against transformers' final hidden states of each adapter merged by peft."""
    model_dir, paths, runner, limits = served
    pooler = Runner(runner.model, pooling="mean", adapters=runner.adapters)
    config = runner.model.config
    blocks = BLOCKS_PER_SEQ * len(PROMPTS)
    pooler.attach(torch.zeros(config.num_hidden_layers, 2, blocks, BLOCK, config.num_key_value_heads, 16))
    tables = [list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(PROMPTS))]
    request = forward_request(PROMPTS, [0] * len(PROMPTS), tables, block_size=BLOCK, sample=[False] * 4)
    request.lora_ids.extend([0, *(runner.adapters.by_name[name].id for name in paths)])
    request.pool.extend([True] * len(PROMPTS))
    batch = ForwardBatch.from_request(request, replace(limits, pooling="mean"))
    pooled = pooler.outputs(batch)[1] / torch.tensor([[len(prompt)] for prompt in PROMPTS])
    for row, adapter in enumerate(["", *paths]):
        expected = merged_hidden(model_dir, paths.get(adapter), PROMPTS[row]).mean(0)
        torch.testing.assert_close(pooled[row], expected, rtol=1e-4, atol=1e-4, msg=adapter or "base")
    assert not torch.allclose(pooled[0], pooled[1], rtol=1e-3, atol=1e-3), "the adapter changes the rows"


def test_steps_naming_no_resident_adapter_are_refused(served):
    _, _, runner, limits = served
    with pytest.raises(InvalidArgument, match=r"lora_ids \[9\] name no resident adapter"):
        _step(runner, limits, [PROMPTS[0]], [0], [9])
    with pytest.raises(InvalidArgument, match="lora_ids has 2 entries for 1 sequences"):
        _step(runner, limits, [PROMPTS[0]], [0], [0, 1])


def test_adapters_that_do_not_fit_are_refused_at_load(served, tmp_path):
    model_dir, paths, runner, _ = served
    adapters, before = runner.adapters, dict(runner.adapters.by_name)
    wide = save_adapter(model_dir, tmp_path / "wide", 16, ["down_proj"], seed=5)
    with pytest.raises(AdapterError, match="rank 16, over --max-lora-rank 8"):
        adapters.load("wide", str(wide))
    with pytest.raises(AdapterError, match="name 'a' is taken"):
        adapters.load("a", str(paths["a"]))
    other = save_tiny_llama(tmp_path / "other", hidden_size=32, intermediate_size=64)
    with pytest.raises(AdapterError, match="it was trained on another base"):
        adapters.load("other", str(save_adapter(other, tmp_path / "o", 2, ["o_proj", "down_proj"], seed=6)))
    renamed = tmp_path / "renamed"
    shutil.copytree(paths["c"], renamed)
    tensors = load_file(renamed / WEIGHTS)
    save_file(
        {key.replace("down_proj", "router"): value for key, value in tensors.items()}, renamed / WEIGHTS
    )
    with pytest.raises(AdapterError, match="targets router of layer 0, which this model does not have"):
        adapters.load("renamed", str(renamed))
    with pytest.raises(AdapterError, match="must hold adapter_config.json"):
        adapters.load("missing", str(tmp_path / "nowhere"))
    assert adapters.by_name == before


@pytest.mark.parametrize(
    ("lengths", "slots", "padded"),
    [
        ((1, 1, 1, 1, 1, 1), (0, 2, 0, -1, 2, 1), True),  # decodes: one batched shrink and expand
        ((5, 1, 3, 2), (1, -1, 0, 1), True),  # padded groups, the padding left out
        ((40, 1, 1), (2, 0, 1), False),  # a long prompt beside decodes: a product pair per group
    ],
)
def test_grouped_rows_add_each_rows_own_adapter(lengths, slots, padded):
    torch.manual_seed(0)
    base = torch.nn.Linear(12, 10)
    linear = LoraLinear(base, 12, 10, [(0, 6), (6, 10)])
    linear.reserve(3, 4, torch.float32, torch.device("cpu"))
    pairs = {}
    for slot, rank in enumerate((4, 2, 3)):
        a1, b1, a2, b2 = (
            torch.randn(rank, 12),
            torch.randn(6, rank),
            torch.randn(rank, 12),
            torch.randn(4, rank),
        )
        linear.add(slot, [(0, a1, b1), (1, a2, b2)])
        pairs[slot] = (a1, b1, a2, b2)
    x = torch.randn(sum(lengths), 12)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    rows = StepRows.of(torch.tensor(slots), cu)
    assert (rows.padded is not None) == padded
    set_rows(rows)
    try:
        y = linear(x)
    finally:
        set_rows(None)
    expected = base(x)
    for seq, slot in enumerate(slots):
        if slot >= 0:
            a1, b1, a2, b2 = pairs[slot]
            part = x[cu[seq] : cu[seq + 1]]
            expected[cu[seq] : cu[seq + 1]] += torch.cat((part @ a1.T @ b1.T, part @ a2.T @ b2.T), dim=1)
    torch.testing.assert_close(y, expected)


def test_following_and_drafting_steps_keep_each_rows_adapter():
    request = forward_request([[5], [6], [7]], [8, 8, 8], [[0, 1], [2, 3], [4, 5]], block_size=BLOCK)
    request.lora_ids.extend([2, 0, 1])
    first = ForwardBatch.from_request(request, Limits(256, 512, 6, BLOCK))
    following = first.following(torch.tensor([9, 9, 9]), [0, 2], BLOCK)
    assert following.lora_ids.tolist() == [2, 1]
    drafting = step_batch(first, [1, 2], [[9, 10], [9]], [9, 9], BLOCK)
    assert drafting.lora_ids.tolist() == [0, 1]


@pytest.fixture(scope="module")
def unloadable(tmp_path_factory):
    """A tiny Llama directory whose weights file is not safetensors (loading the model fails), with adapters
    of it (ranks 8, 4 and 16) and a rank-2 adapter of a narrower Llama, saved before the weights were
    spoilt."""
    root = tmp_path_factory.mktemp("unloadable")
    model_dir = save_tiny_llama(root / "model")
    paths = {
        "chat": save_adapter(model_dir, root / "chat", 8, LLAMA_ATTENTION, seed=1),
        "fits": save_adapter(model_dir, root / "fits", 4, ["k_proj", "up_proj"], seed=3),
        "wide": save_adapter(model_dir, root / "wide", 16, ["q_proj"], seed=4),
        "narrow": save_adapter(
            save_tiny_llama(root / "narrow", hidden_size=32, intermediate_size=64),
            root / "narrow-adapter",
            2,
            ["o_proj", "down_proj"],
            seed=2,
        ),
    }
    (model_dir / "model.safetensors").write_bytes(b"not safetensors")
    return model_dir, paths


@pytest.mark.parametrize(
    ("adapter", "refusal"),
    [
        ("chat", "adapter 'chat' has rank 8, over --max-lora-rank 4"),
        (
            "narrow",
            "adapter 'narrow': layer 0 down_proj is [32, 64] in the adapter but [64, 128] in the model's "
            "config.json: it was trained on another base",
        ),
    ],
)
def test_compute_refuses_an_adapter_at_start_in_one_line_before_the_model_loads(
    unloadable, tmp_path, adapter, refusal
):
    """The model's weights cannot load: the adapter's refusal shows that it came first."""
    model_dir, paths = unloadable
    argv = ["--model", str(model_dir), "--socket", str(tmp_path / "compute.sock"), "--log-level", "error"]
    argv += ["--lora-modules", f"{adapter}={paths[adapter]}", "--max-lora-rank", "4"]
    done = subprocess.run(
        [sys.executable, "-m", "compute_service", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == REFUSED, done.stderr
    refusals = [line for line in done.stderr.splitlines() if line.startswith("compute_service:")]
    assert refusals == [f"compute_service: {refusal}"]


@pytest.mark.parametrize(
    ("shape", "modules", "says"),
    [
        ({}, ["a={wide}"], "adapter 'a' has rank 16, over --max-lora-rank 8"),
        ({"num_hidden_layers": 1}, ["a={fits}"], "targets layer 1, but the model has 1 layers"),
        ({"num_key_value_heads": 4}, ["a={fits}"], "layer 0 k_proj is [32, 64] in the adapter but [64, 64]"),
        ({"intermediate_size": 96}, ["a={fits}"], "layer 0 up_proj is [128, 64] in the adapter but [96, 64]"),
        ({}, ["a={fits}", "a={fits}"], "adapter name 'a' is taken"),
        ({}, ["a={fits}", "b={fits}", "c={fits}"], "names 3 adapters, over --max-loras 2"),
        ({}, ["a={tmp}"], "must hold adapter_config.json and adapter_model.safetensors"),
    ],
)
def test_adapters_are_checked_against_the_config_before_the_model_loads(
    unloadable, tmp_path, shape, modules, says
):
    _, paths = unloadable
    named = [module.format(**paths, tmp=tmp_path) for module in modules]
    with pytest.raises(AdapterError, match=re.escape(says)):
        check_flags(tiny_llama_config(**shape), False, named, 2, 8)
    check_flags(tiny_llama_config(), False, [f"a={paths['fits']}"], 2, 8)
