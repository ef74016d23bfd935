"""Every architecture compute serves, loaded as compute loads it (compute_service.model_loader.load) from a
tiny random-weight directory, generates transformers' eager greedy tokens token for token in float32 on every
CPU-run attention backend: a prompt alone, and packed steps that hold a prompt cut in two chunks, a prompt
beside that chunk, a prompt whose first blocks are another's (a prefix hit) and decodes, every prompt longer
than every sliding window."""

import functools
import json

import pytest
import torch
from transformers import AutoConfig

from compute_service import architectures, fused
from compute_service.model_loader import load
from tests.architectures import CONFIGS, FAST_PATH, SLIDING_WINDOWS, UNFUSED, save_tiny, tiny_config
from tests.paged_greedy import (
    ALONE,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    Served,
    alone_greedy,
    assert_equal_greedy,
    packed_greedy,
)

# The CPU-run backends; cuda runs its torch path on the cpu (the kernel's arguments and semantics).
BACKENDS = ("cpu", "cpu-native", "cuda")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    return functools.cache(lambda name: save_tiny(name, root / name))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_equal_transformers_eager(model_dirs, name, backend):
    path = model_dirs(name)
    served = Served(path, backend)
    a, b, c = packed_greedy(served)
    assert_equal_greedy(path, PROMPT_A, a, "the chunked prompt")
    assert_equal_greedy(path, PROMPT_B, b, "the prompt packed beside a chunk")
    assert_equal_greedy(path, PROMPT_C, c, "the prompt over another's cached blocks")
    alone = alone_greedy(served)
    assert_equal_greedy(path, ALONE, alone, "a prompt alone")
    assert len({token for token, _ in alone + a}) > 2, "a degenerate model would not test attention"


@pytest.mark.parametrize("name", CONFIGS)
def test_the_layer_pattern_is_what_transformers_masks_apply(name):
    config = tiny_config(name)
    assert architectures.sliding_windows(config) == SLIDING_WINDOWS[name]
    assert all(
        window < min(map(len, (PROMPT_A, PROMPT_B, PROMPT_C, ALONE))) for window in SLIDING_WINDOWS[name]
    )
    softcap = 5.0 if name == "gemma2" else 0.0
    assert {layer.softcap for layer in architectures.layer_attention(config)} == {softcap}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_spec_reports_the_pattern_and_the_forward(model_dirs, name):
    _, spec = load(str(model_dirs(name)), torch.float32, "cpu-native")
    plan = spec.plan
    assert plan.architecture == tiny_config(name).model_type
    assert spec.sliding_windows == SLIDING_WINDOWS[name]
    layers = (plan.layers.implementation, plan.decode_layers.implementation)
    assert layers == FAST_PATH.get(plan.architecture, UNFUSED)
    if plan.architecture not in FAST_PATH:
        assert plan.layers.reason.startswith(fused.UNFUSED_LAYERS[plan.architecture])


def test_an_older_config_with_sliding_window_pattern_only_gets_its_windows(tmp_path):
    """Gemma 3 checkpoints written before layer_types name the pattern instead (every Nth layer global)."""
    config = tiny_config("gemma3_text").to_dict()
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window_pattern": 3}))
    windows = architectures.sliding_windows(AutoConfig.from_pretrained(tmp_path))
    assert windows == (9, 9, 0, 9, 9, 0)
