"""What compute does not serve is refused at start-up with one line naming it and what is served: encoder-
decoder, encoder-only and multimodal checkpoints, unknown model types, attention it does not implement,
quantised checkpoints, a length beyond the model's; and an attention call it cannot serve is refused as
UNIMPLEMENTED, never answered wrongly."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    BertConfig,
    Gemma3Config,
    Gemma3TextConfig,
    GPT2Config,
    LlavaConfig,
    Phi3Config,
    T5Config,
    WhisperConfig,
)

from common.errors import Unimplemented
from common.options import REFUSED
from compute_service import architectures
from compute_service.architectures import LayerAttention, UnsupportedModel
from compute_service.attention import cpu, cpu_native
from compute_service.attention.context import build_context, reset_context, set_context
from compute_service.model_loader import load
from tests.architectures import BASE, save_tiny, tiny_config
from tests.device_steps import make_step

SERVED = "llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, mixtral, qwen2_moe, qwen3_moe, olmoe"


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        (T5Config(), "'t5' is an encoder-decoder model"),
        (WhisperConfig(), "'whisper' is an encoder-decoder model"),
        (BertConfig(), "'bert' is an encoder-only model"),
        (Gemma3Config(), "'gemma3' is a multimodal model"),
        (LlavaConfig(), "'llava' is a multimodal model"),
        (GPT2Config(), "'gpt2' is not a model type pagedserve knows"),
    ],
    ids=lambda value: getattr(value, "model_type", ""),
)
def test_other_kinds_of_model_are_refused_naming_what_is_served(config, kind):
    with pytest.raises(UnsupportedModel) as refused:
        architectures.check(config)
    message = str(refused.value)
    assert kind in message and f"decoder-only text models of the types {SERVED}" in message
    assert "\n" not in message


def test_attention_it_does_not_implement_is_refused_naming_the_layer():
    config = Gemma3TextConfig(**{**BASE, "num_hidden_layers": 3})
    config.layer_types = ["sliding_attention", "chunked_attention", "full_attention"]
    with pytest.raises(
        UnsupportedModel, match="layer 1 is 'chunked_attention' attention.*serves full_attention"
    ):
        architectures.check(config)
    bidirectional = Gemma3TextConfig(**BASE, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModel, match="use_bidirectional_attention .* serves causal decoders"):
        architectures.check(bidirectional)


def test_a_quantised_checkpoint_is_refused_naming_the_method():
    config = Phi3Config(**BASE)
    config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(UnsupportedModel, match="a gptq-quantised checkpoint is not served.*--weights int8"):
        architectures.check(config)


def test_the_refusal_comes_before_any_weight_is_read(tmp_path, monkeypatch):
    T5Config(d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2).save_pretrained(tmp_path)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", pytest.fail)
    with pytest.raises(UnsupportedModel, match="'t5' is an encoder-decoder model"):
        load(str(tmp_path), torch.float32, "cpu")


def test_compute_exits_with_one_line_and_the_refused_status(tmp_path):
    """The service process itself (its own logging, its own exit), as `pagedserve up` starts it."""
    BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path), "--socket", str(tmp_path / "compute.sock"), "--log-level", "error"]
    done = subprocess.run(
        [sys.executable, "-m", "compute_service", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == REFUSED, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compute_service: model_type 'bert' is an encoder-only")


def test_max_model_len_caps_the_length_and_is_refused_beyond_it(tmp_path):
    path = save_tiny("mistral", tmp_path / "mistral")
    _, spec = load(str(path), torch.float32, "cpu", max_model_len=100)
    assert spec.max_model_len == 100
    with pytest.raises(
        ValueError, match="--max-model-len 513 is beyond this model's 512 tokens: pass at most 512"
    ):
        load(str(path), torch.float32, "cpu", max_model_len=513)


def test_length_dependent_rotary_embeddings_are_served_within_their_original_length():
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
    }
    config = Phi3Config(**BASE, rope_parameters=longrope, original_max_position_embeddings=128)
    assert architectures.max_model_len(config) == 128
    assert architectures.max_model_len(tiny_config("llama-dynamic-rope")) == BASE["max_position_embeddings"]


def attend_once(backend, attends: LayerAttention, mask=None, **kwargs) -> None:
    step = make_step([3, 1], [0, 5], block_size=4)
    set_context(build_context([step.k_before], [step.v_before], step.batch, layers=(attends,)))
    try:
        q, k, v = (t.transpose(0, 1)[None] for t in (step.q, step.k, step.v))
        backend(SimpleNamespace(layer_idx=0), q, k, v, mask, scaling=0.25, **kwargs)
    finally:
        reset_context()


@pytest.mark.parametrize("backend", [cpu.paged_attention, cpu_native.paged_attention])
def test_an_attention_call_paged_attention_cannot_serve_is_unimplemented(backend):
    sliding = LayerAttention(8)
    attend_once(backend, sliding, sliding_window=8)
    attend_once(backend, sliding)
    with pytest.raises(Unimplemented, match="layer 0 calls paged attention with a mask of its own"):
        attend_once(backend, sliding, mask=torch.zeros(1, 1, 4, 4))
    with pytest.raises(Unimplemented, match=r"arguments it does not know \(s_aux\)"):
        attend_once(backend, sliding, s_aux=torch.zeros(6))
    with pytest.raises(
        Unimplemented, match="sliding_window=4, softcap=0.0, where the model's config gives window 8"
    ):
        attend_once(backend, sliding, sliding_window=4)
    with pytest.raises(Unimplemented, match="softcap=30.0"):
        attend_once(backend, sliding, softcap=30.0)
