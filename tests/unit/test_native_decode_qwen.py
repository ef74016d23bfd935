"""The native decode stack on Qwen2 (QKV biases, a tied output head) and Qwen3 (per-head QK RMSNorm) against
the fused Python layers it stands in for: the same logits on all-decode steps of several sequences, float32,
int8 and bfloat16 products, full attention, a window on every layer, and two KV groups (a full and a
sliding layer, each group its own tables); the plan runs it for them; the biases and head norms of these
random-weight models are drawn (tests/architectures.py), so a stack that dropped them would differ."""

import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen2Config, Qwen3Config

from compute_service import kernels
from compute_service.batch import ForwardBatch
from compute_service.model_loader import load
from compute_service.pool_layout import pool_layout
from compute_service.runner import Runner
from compute_service.validation import Limits
from protos import common_pb2
from tests.architectures import BASE, SLIDING_WINDOWS, draw_biases_and_head_norms, tiny_config
from tests.forward import forward_request
from tests.tiny_model import needs_native_bfloat16

BLOCK_SIZE, NUM_BLOCKS, WINDOW = 4, 96, 11
# Contexts below and beyond the window, for several sequences decoding one token each.
CACHED = [4, 9, 13, 22, 30]

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the native kernels cannot be built here")

# name -> config: full attention on every layer, or one window on every layer (one KV group either way).
CONFIGS = {
    "qwen2": lambda: Qwen2Config(**BASE, tie_word_embeddings=True),
    "qwen2-sliding": lambda: Qwen2Config(
        **BASE, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0
    ),
    "qwen3": lambda: Qwen3Config(**BASE),
    "qwen3-sliding": lambda: Qwen3Config(
        **BASE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0
    ),
}


def save(config: PretrainedConfig, path) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    draw_biases_and_head_norms(model)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A saved model by name: CONFIGS', or NAME-groups for tests/architectures.py's config NAME."""
    root = tmp_path_factory.mktemp("qwen")
    saved = {}

    def path(name: str) -> str:
        if name not in saved:
            config = CONFIGS[name]() if name in CONFIGS else tiny_config(name.removesuffix("-groups"))
            saved[name] = save(config, root / name)
        return saved[name]

    return path


def loaded(path: str, **options):
    model, spec = load(path, torch.float32, backend="cpu-native", **options)
    assert spec.plan.native_decode, spec.plan.decode_layers.reason
    assert model.model.native_decode is not None
    return model


def both(model, step, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's logits through the native stack (which must run once) and through the Python layers."""
    module, calls = kernels.load(), []
    real = module.decode_layers
    monkeypatch.setattr(module, "decode_layers", lambda *args: calls.append(1) or real(*args))
    stack = model.model.native_decode
    try:
        native_logits = step()
        model.model.native_decode = None
        python_logits = step()
    finally:
        model.model.native_decode = stack
        monkeypatch.undo()
    assert calls == [1], "one native step"
    return native_logits, python_logits


def decode_step(model, seed: int) -> tuple[Runner, ForwardBatch]:
    """Five sequences over a one-group pool of random K/V, each decoding one token."""
    config = model.config
    torch.manual_seed(seed)
    runner = Runner(model)
    shape = (config.num_hidden_layers, 2, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    runner.attach(torch.randn(shape) * 0.5)
    limits = Limits(config.vocab_size, config.max_position_embeddings, NUM_BLOCKS, BLOCK_SIZE)
    blocks = torch.randperm(NUM_BLOCKS).tolist()
    tables = [blocks[i * 8 : (i + 1) * 8] for i in range(len(CACHED))]
    new = [[int(t)] for t in torch.randint(3, 256, (len(CACHED),))]
    request = forward_request(new, CACHED, tables, block_size=BLOCK_SIZE)
    return runner, ForwardBatch.from_request(request, limits)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
def test_all_decode_steps_give_the_python_layers_logits(model_dirs, monkeypatch, name, weights):
    model = loaded(model_dirs(name), weights=weights)
    stack = model.model.native_decode
    windows = (WINDOW,) * 2 if name.endswith("sliding") else (0, 0)
    assert tuple(stack.windows) == windows
    qwen3 = name.startswith("qwen3")
    # Qwen2: q/k/v biases in the QKV product (the other three products' empty); Qwen3: two head norms a layer
    assert len(stack.biases) == (0 if qwen3 else 8) and len(stack.head_norms) == (4 if qwen3 else 0)
    runner, batch = decode_step(model, seed=len(name))
    got, expected = both(model, lambda: runner.logits(batch), monkeypatch)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@needs_native_bfloat16
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_bfloat16_products_add_the_bias_after_the_cast_back(model_dirs, monkeypatch, name):
    model = loaded(model_dirs(name), weights="bfloat16")
    assert all(weight.is_mkldnn for weight in model.model.native_decode.weights if weight.dim() > 1)
    runner, batch = decode_step(model, seed=3)
    got, expected = both(model, lambda: runner.logits(batch), monkeypatch)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("name", "dropped"), [("qwen2", "biases"), ("qwen3", "head_norms")])
def test_the_drawn_biases_and_head_norms_change_the_logits(model_dirs, monkeypatch, name, dropped):
    """The parity above depends on them: the stack without them gives other logits."""
    model = loaded(model_dirs(name))
    stack = model.model.native_decode
    runner, batch = decode_step(model, seed=9)
    kept = getattr(stack, dropped)
    setattr(stack, dropped, [])
    try:
        got, expected = both(model, lambda: runner.logits(batch), monkeypatch)
    finally:
        setattr(stack, dropped, kept)
    assert (got - expected).abs().max() > 1e-2


def grouped_request(new, cached, tables: list[list[list[int]]]):
    """One step whose sequences hold tables[g][i] in KV group g."""
    parts = [forward_request(new, cached, group, block_size=BLOCK_SIZE) for group in tables]
    request = parts[0]
    assert parts[1].block_table_width == request.block_table_width
    request.block_tables.extend(parts[1].block_tables)
    request.num_kv_groups = 2
    return request


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_two_kv_groups_each_store_and_attend_by_their_own_tables(model_dirs, monkeypatch, name):
    """tests/architectures.py's configs: layer 0 full, layer 1 sliding, a group each over one layer slot."""
    windows = SLIDING_WINDOWS[name]
    model = loaded(model_dirs(f"{name}-groups"))
    config = model.config
    handle = common_pb2.PoolHandle(
        shape=[1, 2, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim],
        kv_groups=[common_pb2.KVGroupLayout(layers=[i], window=windows[i]) for i in (0, 1)],
    )
    layout = pool_layout(handle, windows)
    assert layout.num_groups == 2 and layout.groups == (0, 1)
    torch.manual_seed(4)
    runner = Runner(model)
    pool = torch.randn(1, 2, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim) * 0.5
    runner.attach(pool, layout)
    limits = Limits(config.vocab_size, config.max_position_embeddings, NUM_BLOCKS, BLOCK_SIZE, num_groups=2)
    order = torch.randperm(NUM_BLOCKS).tolist()
    tables = [[order[(2 * i + g) * 8 : (2 * i + g + 1) * 8] for i in range(len(CACHED))] for g in (0, 1)]
    new = [[int(t)] for t in torch.randint(3, 256, (len(CACHED),))]
    batch = ForwardBatch.from_request(grouped_request(new, CACHED, tables), limits)
    slots = [group.slot_mapping for group in batch.by_group()]
    assert not torch.equal(*slots), "the groups store at different slots"
    got, expected = both(model, lambda: runner.logits(batch), monkeypatch)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
