"""Loads a Hugging Face causal LM unmodified, its attention routed to a registered paged backend, and builds
it to its execution plan (compute_service.plan): fused layers, linear kernels, the native decode stack."""

from collections.abc import Callable
from dataclasses import dataclass, replace

import structlog
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PreTrainedModel

from common.model_files import ModelFiles, local_copy
from common.shared_pool import dtype_from_name, dtype_name
from common.sparse_settings import SparseMode
from compute_service import architectures, kernels, planning, vision
from compute_service.attention.context import timed
from compute_service.attention.kv_codec import NO_SCALES, KVScales
from compute_service.attention.registry import get_backend
from compute_service.experts import pack_experts
from compute_service.fused import fuse
from compute_service.kv_calibration import calibrate
from compute_service.linear import replace_linears
from compute_service.llama_layer import native_row_ops
from compute_service.native_decode import NativeDecode
from compute_service.plan import TRANSFORMERS, ExecutionPlan
from compute_service.planning import Flags
from compute_service.pooling import Pooling
from compute_service.vision import VisionSpec


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of the system needs to know about the model: pool geometry, token limits, and how each
    stage of a step runs (`plan`)."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    plan: ExecutionPlan
    # What the pool stores K/V as (the weights' dtype unless --kv-dtype), and its fp8 scales.
    kv_dtype: torch.dtype
    kv_scales: KVScales = NO_SCALES
    # Each layer's sliding window (0: full attention), the groups of layers a KV cache can keep apart.
    sliding_windows: tuple[int, ...] = ()
    # How the model pools embeddings (compute_service.pooling; None: it does not pool).
    pooling: Pooling | None = None
    # The ranks the model's heads are split over (--tensor-parallel-size; compute_service.tensor_parallel).
    tensor_parallel_size: int = 1
    # A vision-language model's family and image token (compute_service.vision; None: a text model).
    vision: VisionSpec | None = None

    @property
    def attention_backend(self) -> str:
        return self.plan.attention_backend

    @property
    def weights(self) -> str:
        """How the linear layers hold their weights (--weights): the dtype's name, or int8 / int4."""
        return self.plan.weights

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
    max_model_len: int = 0,
    sparse_attention: SparseMode | None = None,
) -> tuple[PreTrainedModel, ModelSpec]:
    """The model with paged attention on `device` (a torch device name), built to the plan of these flags on
    this machine (compute_service.planning); K/V stored as `kv_dtype` (default: `dtype`), an fp8 one
    calibrated here (compute_service.kv_calibration); sequences served up to `max_model_len` tokens (0: the
    model's own length), decodes block-sparse under `sparse_attention`. ValueError, before the weights
    load, for flags that cannot run together or here and for a checkpoint compute does not serve
    (compute_service.architectures); FileNotFoundError for a model that is not there."""
    flags = Flags(
        dtype, weights, kv_dtype, device, backend, plain_linear, fused, max_model_len, sparse_attention
    )
    return load_planned(*plan_for(model, flags))


def plan_for(model: str, flags: Flags) -> tuple[ModelFiles, ExecutionPlan]:
    """The model's local files and its plan under `flags`; the flags are checked before the files are read."""
    machine = planning.this_machine()
    planning.check(flags, machine)
    files = local_copy(model)
    config = vision.text_config(AutoConfig.from_pretrained(files.path))
    return files, planning.resolve(config, flags, machine)


def load_planned(
    files: ModelFiles, plan: ExecutionPlan, shard: Callable[[PreTrainedModel], None] | None = None
) -> tuple[PreTrainedModel, ModelSpec]:
    """The model of `files` built to `plan` (see `load`); `shard` splits it in place once loaded, before
    anything else is built on its weights (compute_service.tensor_parallel)."""
    dtype, kv_dtype = dtype_from_name(plan.dtype), dtype_from_name(plan.kv_dtype)
    attention = register_attention(plan.attention_backend)
    if vision.is_vision(AutoConfig.from_pretrained(files.path)):
        hf_model = vision.load(files.path, dtype, attention, plan.device)
    else:
        hf_model = (
            AutoModelForCausalLM.from_pretrained(files.path, dtype=dtype, attn_implementation=attention)
            .eval()
            .to(plan.device)
        )
    if shard is not None:
        shard(hf_model)
    spec = model_spec(hf_model, files.name, plan, kv_dtype)
    spec = replace(spec, kv_scales=calibrate(hf_model, files.path, kv_dtype))
    if plan.fused:
        # NOTE: fused before the linears are replaced: fusing stacks the plain weights they hide.
        fuse(hf_model)
    replace_linears(hf_model, plan.decoder_linears, plan.head_linear)
    experts = 0
    if plan.decoder_linears.kernel != TRANSFORMERS:
        experts = pack_experts(hf_model, plan.decoder_linears)
    if plan.native_decode:
        hf_model.model.native_decode = NativeDecode(list(hf_model.model.layers), spec.sliding_windows)
        hf_model.model.row_ops = native_row_ops(kernels.load())
    structlog.get_logger().info(
        "model_architecture",
        architecture=plan.architecture,
        sliding_windows=_runs(spec.sliding_windows),
        rope=",".join(architectures.rope_types(hf_model.config)),
        max_model_len=spec.max_model_len,
        packed_expert_layers=experts,
    )
    return hf_model, spec


def _runs(windows: tuple[int, ...]) -> str:
    """Layer windows as runs, e.g. '4x4096,1xfull' (for the log)."""
    runs: list[list] = []
    for window in windows:
        if runs and runs[-1][1] == window:
            runs[-1][0] += 1
        else:
            runs.append([1, window])
    return ",".join(f"{count}x{window or 'full'}" for count, window in runs)


def model_spec(
    model: PreTrainedModel, name: str, plan: ExecutionPlan, kv_dtype: torch.dtype | None = None
) -> ModelSpec:
    config = model.config
    num_heads = config.num_attention_heads
    vocab_size, outputs = (
        model.get_input_embeddings().num_embeddings,
        model.get_output_embeddings().out_features,
    )
    if vocab_size != outputs:
        raise architectures.UnsupportedModel(
            f"{config.model_type}: the input vocabulary ({vocab_size}) and the output head ({outputs}) "
            "differ; pagedserve serves models whose logits cover their input tokens"
        )
    return ModelSpec(
        sliding_windows=architectures.sliding_windows(config),
        name=name,
        num_layers=config.num_hidden_layers,
        num_attention_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        dtype=model.dtype,
        vocab_size=vocab_size,
        max_model_len=plan.max_model_len,
        eos_token_ids=_eos_token_ids(config.eos_token_id, model.generation_config.eos_token_id),
        plan=plan,
        kv_dtype=model.dtype if kv_dtype is None else kv_dtype,
        vision=model.vision.spec if hasattr(model, "vision") else None,
    )


def _eos_token_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: set[int] = set()
    for value in values:
        ids.update([value] if isinstance(value, int) else value or [])
    return tuple(sorted(ids))
