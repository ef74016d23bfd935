"""Loads a Hugging Face causal LM unmodified, its attention routed to a registered paged backend."""

from dataclasses import dataclass, replace

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel

from common.cpu import bfloat16_native
from common.model_files import local_copy
from common.shared_pool import dtype_name
from compute_service import kernels, native_decode
from compute_service.attention.context import timed
from compute_service.attention.kv_codec import NO_SCALES, KVScales
from compute_service.attention.registry import get_backend, require_kv_dtype
from compute_service.fused import fuse
from compute_service.kv_calibration import calibrate
from compute_service.linear import pack_linears
from compute_service.quantized import MIXED_PRECISION, QUANTIZED_MODES, quantize_linears, resolve_weights


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of the system needs to know about the model: pool geometry and token limits."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    attention_backend: str
    # What the pool stores K/V as (the weights' dtype unless --kv-dtype), and its fp8 scales.
    kv_dtype: torch.dtype
    kv_scales: KVScales = NO_SCALES
    # How the linear layers hold their weights (--weights): the dtype's name, or int8 / int4.
    weights: str = ""

    def __post_init__(self) -> None:
        if not self.weights:
            object.__setattr__(self, "weights", self.dtype_name)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def kv_dtype_name(self) -> str:
        return dtype_name(self.kv_dtype)


def register_attention(backend: str) -> str:
    """Registers the backend with transformers; returns the `attn_implementation` name to load models with."""
    name = f"pagedserve_{backend}"
    AttentionInterface.register(name, timed(get_backend(backend)))
    return name


def load(
    model: str,
    dtype: torch.dtype,
    backend: str = "cpu",
    plain_linear: bool = False,
    kv_dtype: torch.dtype | None = None,
    device: str = "cpu",
    fused: bool = True,
    weights: str = "auto",
) -> tuple[PreTrainedModel, ModelSpec]:
    """The model with paged attention; its float32 CPU linear layers run on oneDNN with weights packed once
    (compute_service.linear) unless `plain_linear`; a Llama-family model runs on fused projections and a
    lighter layer forward (compute_service.fused) unless not `fused`; the linears hold int8/int4 weights if
    `weights` says so (compute_service.quantized), or bfloat16 ones in a float32 model on a cpu that
    multiplies bfloat16 natively (compute_service.linear). K/V are stored as `kv_dtype` (default: `dtype`);
    an fp8 one is calibrated here (compute_service.kv_calibration). The model is placed on `device` (a torch
    device name). ValueError if the backend cannot store it or a layer cannot be quantised."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    weights = resolve_weights(weights, dtype_name(dtype))
    if weights in QUANTIZED_MODES and device != "cpu":
        raise ValueError(f"--weights {weights} runs torch's CPU kernels; on {device} use --weights auto")
    if plain_linear and weights != dtype_name(dtype):
        raise ValueError(
            f"--plain-linear keeps dense nn.Linear layers; it cannot combine with --weights {weights}"
        )
    mixed = (dtype_name(dtype), weights) == MIXED_PRECISION
    if mixed and (device != "cpu" or not bfloat16_native()):
        raise ValueError(
            "--weights bfloat16 with --dtype float32 runs oneDNN's bfloat16 products, which need a cpu with "
            "AVX512-BF16 or AMX (this one would emulate them ~30x slower): use --weights auto, int8 or int4"
        )
    require_kv_dtype(backend, dtype_name(kv_dtype))
    if backend == "cpu-native" and kernels.load() is None:
        raise ValueError(
            "attention backend cpu-native: its kernel cannot be built here (see the log); use cpu"
        )
    files = local_copy(model)
    hf_model = (
        AutoModelForCausalLM.from_pretrained(
            files.path, dtype=dtype, attn_implementation=register_attention(backend)
        )
        .eval()
        .to(device)
    )
    spec = replace(model_spec(hf_model, files.name, backend, kv_dtype), weights=weights)
    spec = replace(spec, kv_scales=calibrate(hf_model, files.path, kv_dtype))
    if fused:
        # NOTE: fused before quantised: fusing stacks dense weights, and the fused linears are quantised too.
        fuse(hf_model)
    quantize_linears(hf_model, weights)
    if not plain_linear:
        # NOTE: last, since packing hides the plain weights that fusing and quantising read.
        pack_linears(hf_model, torch.bfloat16 if mixed else torch.float32)
        native_decode.enable(hf_model)
    return hf_model, spec


def model_spec(
    model: PreTrainedModel, name: str, backend: str, kv_dtype: torch.dtype | None = None
) -> ModelSpec:
    config = model.config
    num_heads = config.num_attention_heads
    vocab_size = model.get_input_embeddings().num_embeddings
    assert vocab_size == model.get_output_embeddings().out_features, "input and output vocabularies differ"
    return ModelSpec(
        name=name,
        num_layers=config.num_hidden_layers,
        num_attention_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        dtype=model.dtype,
        vocab_size=vocab_size,
        max_model_len=config.max_position_embeddings,
        eos_token_ids=_eos_token_ids(config.eos_token_id, model.generation_config.eos_token_id),
        attention_backend=backend,
        kv_dtype=model.dtype if kv_dtype is None else kv_dtype,
    )


def _eos_token_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: set[int] = set()
    for value in values:
        ids.update([value] if isinstance(value, int) else value or [])
    return tuple(sorted(ids))
