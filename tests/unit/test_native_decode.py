"""The native decode stack (compute_service.native_decode, decode_layers.cpp) against the Python layers it
stands in for: the same logits on all-decode steps, the same greedy tokens over many steps, only where the
execution plan runs it, and its input checks."""

import pytest
import torch

from compute_service import kernels
from compute_service.batch import ForwardBatch
from compute_service.llama_layer import TORCH_ROW_OPS
from compute_service.model_loader import load
from compute_service.runner import Runner
from compute_service.validation import Limits
from tests.forward import forward_request
from tests.tiny_model import needs_native_bfloat16, save_tiny_llama

BLOCK_SIZE, NUM_BLOCKS = 4, 96

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the native kernels cannot be built here")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", initializer_range=0.3))


@pytest.fixture(scope="module")
def model(tiny):
    model, spec = load(tiny, torch.float32, backend="cpu-native")
    assert spec.plan.native_decode
    return model


def runner_for(model, kv_dtype=torch.float32, num_blocks=NUM_BLOCKS) -> tuple[Runner, Limits]:
    config = model.config
    runner = Runner(model)
    shape = (config.num_hidden_layers, 2, num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    runner.attach((torch.randn(shape) * 0.5).to(kv_dtype))
    return runner, Limits(config.vocab_size, config.max_position_embeddings, num_blocks, BLOCK_SIZE)


def both(model, step) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's logits through the native stack and through the Python layers on torch's row-wise ops (the
    pool written alike)."""
    stack, row_ops = model.model.native_decode, model.model.row_ops
    assert stack is not None
    try:
        native_logits = step()
        model.model.native_decode, model.model.row_ops = None, TORCH_ROW_OPS
        python_logits = step()
    finally:
        model.model.native_decode, model.model.row_ops = stack, row_ops
    return native_logits, python_logits


def test_the_loader_enables_it_for_a_packed_fused_float32_model_on_cpu_native(model):
    assert model.model.native_decode is not None


@pytest.mark.parametrize(
    "options",
    [{"backend": "cpu"}, {"plain_linear": True}, {"fused": False}],
    ids=["cpu backend", "plain linear", "unfused"],
)
def test_the_loader_leaves_it_off_where_the_plan_does(tiny, options):
    model, spec = load(tiny, torch.float32, **{"backend": "cpu-native", **options})
    assert getattr(model.model, "native_decode", None) is None
    assert not spec.plan.native_decode and "native decode stack" in spec.plan.decode_layers.reason


@pytest.mark.parametrize("cached", [[7], [3, 12, 4, 9], [0, 1, 5, 8, 16, 23, 2]])
def test_all_decode_steps_give_the_python_layers_logits(model, cached):
    torch.manual_seed(len(cached))
    runner, limits = runner_for(model)
    blocks = torch.randperm(NUM_BLOCKS).tolist()
    tables = [blocks[i * 8 : (i + 1) * 8] for i in range(len(cached))]
    new = [[int(t)] for t in torch.randint(3, 256, (len(cached),))]
    batch = ForwardBatch.from_request(forward_request(new, cached, tables, block_size=BLOCK_SIZE), limits)
    got, expected = both(model, lambda: runner.logits(batch))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_steps_of_many_rows_split_across_threads_give_the_python_layers_logits(model, torch_threads):
    # 300 rows: the norm and SiLU loops split across threads (decode_layers.cpp for_rows)
    torch.set_num_threads(2)
    assert kernels.load().parallel_threads() == 2
    torch.manual_seed(3)
    runner, limits = runner_for(model, num_blocks=300)
    new = [[int(t)] for t in torch.randint(3, 256, (300,))]
    batch = ForwardBatch.from_request(
        forward_request(new, [2] * 300, [[i] for i in range(300)], block_size=BLOCK_SIZE), limits
    )
    got, expected = both(model, lambda: runner.logits(batch))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def assert_three_decodes_match(model, seed: int) -> None:
    """Three sequences decoding one token each: the native stack's logits equal the Python layers'."""
    torch.manual_seed(seed)
    runner, limits = runner_for(model)
    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(3)]
    request = forward_request([[5], [17], [40]], [4, 9, 13], tables, block_size=BLOCK_SIZE)
    batch = ForwardBatch.from_request(request, limits)
    got, expected = both(model, lambda: runner.logits(batch))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@needs_native_bfloat16
def test_bfloat16_weights_run_natively_with_the_python_layers_logits(tiny):
    """Mixed precision (--weights bfloat16): the native stack casts each product's input as the oneDNN
    kernel does."""
    model, _ = load(tiny, torch.float32, backend="cpu-native", weights="bfloat16")
    products = [weight for weight in model.model.native_decode.weights if weight.dim() > 1]
    assert len(products) == 4 * model.config.num_hidden_layers and all(w.is_mkldnn for w in products)
    assert_three_decodes_match(model, seed=5)


@pytest.mark.parametrize(("weights", "packed"), [("int8", torch.int8), ("int4", torch.uint8)])
def test_quantised_panels_run_natively_with_the_python_layers_logits(tiny, weights, packed):
    """--weights int8 or int4: the stack multiplies by the panels and their scales (int4: the groups' scales
    and zero points), as the Panels kernel does."""
    model, _ = load(tiny, torch.float32, backend="cpu-native", weights=weights)
    stack = model.model.native_decode
    assert stack is not None and len(stack.scales) == 4 * model.config.num_hidden_layers
    products = [weight for weight in stack.weights if weight.dim() > 1]
    assert all(w.dtype == packed for w in products)
    assert_three_decodes_match(model, seed=7)


def test_greedy_tokens_over_many_steps_equal_the_python_layers(model):
    """A prompt per sequence (the Python layers), then 24 batched decodes (the native stack)."""

    def run(native_on: bool) -> list[list[int]]:
        stack = model.model.native_decode
        model.model.native_decode = stack if native_on else None
        try:
            torch.manual_seed(3)
            runner, limits = runner_for(model)
            prompts = [torch.randint(3, 256, (n,)).tolist() for n in (5, 11, 2)]
            tables = [list(range(i * 12, (i + 1) * 12)) for i in range(3)]
            new, cached, out = prompts, [0, 0, 0], [[], [], []]
            for _ in range(25):
                request = forward_request(new, cached, tables, block_size=BLOCK_SIZE)
                tokens = runner.forward(ForwardBatch.from_request(request, limits)).tokens.tolist()
                cached = [c + len(n) for c, n in zip(cached, new, strict=True)]
                new = [[t] for t in tokens]
                for seq, token in zip(out, tokens, strict=True):
                    seq.append(token)
            return out
        finally:
            model.model.native_decode = stack

    assert run(True) == run(False)


def test_steps_with_a_prompt_take_the_python_layers(model, monkeypatch):
    runner, limits = runner_for(model)
    calls = []
    module = kernels.load()
    real = module.decode_layers
    monkeypatch.setattr(module, "decode_layers", lambda *args: calls.append(len(args[0])) or real(*args))
    decode = forward_request([[9], [4]], [6, 3], [[1, 2], [3, 4]], block_size=BLOCK_SIZE)
    mixed = forward_request([[9], [4, 5, 6]], [7, 0], [[1, 2], [5, 6]], block_size=BLOCK_SIZE)
    runner.logits(ForwardBatch.from_request(decode, limits))
    runner.logits(ForwardBatch.from_request(mixed, limits))
    assert calls == [2]


def test_bfloat16_pools_run_natively_with_the_python_layers_logits(tiny, monkeypatch):
    model, _ = load(tiny, torch.float32, backend="cpu-native", kv_dtype=torch.bfloat16)
    calls = []
    module = kernels.load()
    real = module.decode_layers
    monkeypatch.setattr(module, "decode_layers", lambda *args: calls.append(args[7][0].dtype) or real(*args))
    torch.manual_seed(0)
    runner, limits = runner_for(model, torch.bfloat16)
    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(3)]
    request = forward_request([[9], [4], [77]], [6, 3, 20], tables, block_size=BLOCK_SIZE)
    batch = ForwardBatch.from_request(request, limits)
    slots = batch.slot_mapping
    before = stored(runner, slots)
    written = []
    native_logits, python_logits = both(
        model, lambda: written.append(stored(runner, slots)) or runner.logits(batch)
    )
    assert calls == [torch.bfloat16], "one native step, on the bfloat16 pool"
    native, python = written[1], stored(runner, slots)
    assert not torch.equal(native, before), "the step's keys and values were stored"
    # NOTE: the paths' float32 K/V may differ by an ulp, which bfloat16 storage can round a bfloat16 ulp apart
    torch.testing.assert_close(native, python, atol=0, rtol=2**-7)
    flipped = int((native != python).sum())
    assert flipped <= native.numel() // 100, f"{flipped} stored values differ"
    tolerance = 1e-4 if flipped == 0 else 2e-3
    torch.testing.assert_close(native_logits, python_logits, atol=tolerance, rtol=tolerance)


def stored(runner: Runner, slots: torch.Tensor) -> torch.Tensor:
    """The K/V of every layer at `slots`, as float32: [layers, 2, slots, heads, head_dim]."""
    return torch.stack(
        [
            torch.stack([k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]])
            for k, v in zip(runner.k_caches, runner.v_caches, strict=True)
        ]
    ).float()


def test_fp8_pools_take_the_python_layers(tiny):
    model, spec = load(tiny, torch.float32, backend="cpu-native", kv_dtype=torch.float8_e4m3fn)
    assert model.model.native_decode is None and not spec.plan.native_decode
    assert "fp8_e4m3 pool" in spec.plan.decode_layers.reason
    runner, limits = runner_for(model, torch.float8_e4m3fn)
    runner.scales = spec.kv_scales
    batch = ForwardBatch.from_request(forward_request([[9]], [6], [[1, 2]], block_size=BLOCK_SIZE), limits)
    assert torch.isfinite(runner.logits(batch)).all()


@pytest.mark.parametrize(
    ("slot", "scales", "sparse", "message"),
    [(NUM_BLOCKS * BLOCK_SIZE, [], None, "slot_mapping must lie inside the pool"),
     (0, [torch.ones(8)], None, "scales must be empty or hold 4 tensors per layer"),
     (0, [], torch.zeros(1, 3, dtype=torch.long), "one block summary tensor \\(empty: dense\\) per layer")],
)  # fmt: skip
def test_refuses_slots_outside_the_pool_stray_scales_and_summaries(model, slot, scales, sparse, message):
    config = model.config
    stack = model.model.native_decode
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim) for _ in range(config.num_hidden_layers)]
    one = torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match=message):
        kernels.load().decode_layers(
            torch.zeros(1, config.hidden_size), torch.ones(1, dim), torch.zeros(1, dim), stack.weights,
            scales, [], [], caches, caches, [torch.tensor([slot])], [torch.zeros(1, 1, dtype=torch.long)], [],
            torch.zeros(1, dtype=torch.long), one, one, heads, kv_heads, 1e-5, dim**-0.5, stack.windows, [],
            sparse,
        )  # fmt: skip
