"""Resolving the execution plan (compute_service.plan) from a model's config, compute's flags and this
machine; each stage's choice is made here and nowhere else. A combination that cannot run is refused with
ValueError naming what to change, before any weight is loaded."""

from dataclasses import dataclass, replace

import torch
from transformers import PretrainedConfig

from common import cpu
from common.shared_pool import dtype_name
from common.sparse_settings import SparseMode
from compute_service import architectures, fused, kernels, native_decode
from compute_service.attention import registry
from compute_service.attention.backend_names import SPARSE
from compute_service.plan import (
    DENSE,
    FUSED,
    NATIVE,
    NATIVE_STACK,
    ONEDNN,
    PANELS,
    TORCH,
    TRANSFORMERS,
    WEIGHT_ONLY,
    Choice,
    ExecutionPlan,
    LinearChoice,
    Machine,
)
from compute_service.quantized import (
    HEAD_MODE,
    MIXED_PRECISION,
    QUANTIZED_MAX_ROWS,
    QUANTIZED_MODES,
    resolve_weights,
)

# The pools the native decode stack stores K/V into (decode_layers.cpp's `store`).
NATIVE_STACK_POOLS = ("float32", "bfloat16")


@dataclass(frozen=True)
class Flags:
    """What compute was asked to run: --dtype (resolved), --weights, --kv-dtype (None: the dtype), the torch
    device, --attention-backend, --plain-linear, not --unfused, --max-model-len (0: the model's own) and
    --sparse-attention (None: off)."""

    dtype: torch.dtype = torch.float32
    weights: str = "auto"
    kv_dtype: torch.dtype | None = None
    device: str = "cpu"
    attention_backend: str = "auto"
    plain_linear: bool = False
    fused: bool = True
    max_model_len: int = 0
    sparse_attention: SparseMode | None = None

    @property
    def device_type(self) -> str:
        """The device's kind: cpu, cuda, npu (torch knows npu only where torch_npu is imported)."""
        return self.device.partition(":")[0]

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def kv_dtype_name(self) -> str:
        return dtype_name(self.dtype if self.kv_dtype is None else self.kv_dtype)


def this_machine() -> Machine:
    """This machine as the plan sees it: common.cpu's answers, and whether the native kernels load."""
    return Machine(
        isa=cpu.isa_level(cpu.cpu_flags()),
        profile=cpu.profile(),
        kernels=kernels.load() is not None,
        bfloat16_native=cpu.bfloat16_native(),
        onednn=torch.backends.mkldnn.is_available(),
    )


def check(flags: Flags, machine: Machine) -> tuple[str, Choice]:
    """The weights mode and the attention backend the flags resolve to; ValueError for a combination that
    cannot run (the config is not needed: this runs before the model's files are read)."""
    weights = resolve_weights(flags.weights, flags.dtype_name)
    if weights in QUANTIZED_MODES and flags.device_type != "cpu":
        raise ValueError(
            f"--weights {weights} runs torch's CPU kernels; on {flags.device} use --weights auto"
        )
    if flags.plain_linear and weights != flags.dtype_name:
        raise ValueError(
            f"--plain-linear keeps dense nn.Linear layers; it cannot combine with --weights {weights}"
        )
    if (flags.dtype_name, weights) == MIXED_PRECISION and (
        flags.device_type != "cpu" or not machine.bfloat16_native
    ):
        raise ValueError(
            "--weights bfloat16 with --dtype float32 runs oneDNN's bfloat16 products, which need a cpu with "
            "AVX512-BF16 or AMX (this one would emulate them many times slower): use --weights auto, int8 "
            "or int4"
        )
    attention = attention_backend(flags, machine)
    registry.require_kv_dtype(attention.implementation, flags.kv_dtype_name)
    if flags.sparse_attention is not None and attention.implementation not in SPARSE:
        raise ValueError(
            f"--sparse-attention runs in the {' or '.join(SPARSE)} attention backend, not in "
            f"{attention.implementation}: pass --attention-backend cpu-native or "
            "leave --sparse-attention off"
        )
    return weights, attention


def resolve(config: PretrainedConfig, flags: Flags, machine: Machine) -> ExecutionPlan:
    """The plan of a model of `config` under `flags` on `machine`; ValueError as `check`, and for a model
    compute does not serve (architectures.UnsupportedModel), attention the backend does not do (a soft-cap)
    or a --max-model-len beyond the model's length."""
    architectures.check(config)
    weights, attention = check(flags, machine)
    backend = attention.implementation
    registry.require_attention(backend, architectures.layer_attention(config))
    sparse = flags.sparse_attention
    if sparse is not None and all(layer.window for layer in architectures.layer_attention(config)):
        raise ValueError(
            f"--sparse-attention: every layer of this {config.model_type} model attends within a sliding "
            "window; block-sparse decode applies to full-attention layers only: leave it off"
        )
    decoder, head = linears(flags, weights, machine)
    layers = layer_forward(config, flags)
    prefill, decode = registry.PATHS[backend]
    decode_reason = _attention_reason(attention, machine)
    if sparse is not None:
        rows = "every decode by default" if sparse.default else "decodes of requests asking for it"
        decode = (
            f"block-sparse for {rows} ({sparse.describe()}, blocks chosen by key min/max bounds; prompts, "
            f"sliding layers and tables within a row's budget dense), then {decode}"
        )
        decode_reason = f"--sparse-attention {sparse.describe()}; {decode_reason}"
    return ExecutionPlan(
        architecture=config.model_type,
        max_model_len=served_length(config, flags.max_model_len),
        device=flags.device,
        dtype=flags.dtype_name,
        weights=weights,
        kv_dtype=flags.kv_dtype_name,
        machine=machine,
        attention_backend=backend,
        layers=layers,
        decode_layers=decode_layers(config, layers, backend, decoder, flags, machine),
        decoder_linears=decoder,
        head_linear=head,
        attention_prefill=Choice(f"{backend}: {prefill}", _attention_reason(attention, machine)),
        attention_decode=Choice(f"{backend}: {decode}", decode_reason),
        greedy=greedy(flags, machine),
        sampling=Choice(TORCH, "temperature, top-k/top-p, penalties, biases and log-probabilities in torch"),
        sparse_attention=sparse,
    )


def served_length(config: PretrainedConfig, max_model_len: int) -> int:
    """--max-model-len checked against the model's own length (architectures.max_model_len); 0: that."""
    own = architectures.max_model_len(config)
    if max_model_len > own:
        raise ValueError(
            f"--max-model-len {max_model_len} is beyond this model's {own} tokens: pass at most {own}"
        )
    return max_model_len or own


def attention_backend(flags: Flags, machine: Machine) -> Choice:
    """The attention backend (`auto`: the device's own; on the cpu, cpu-native for float32 where the
    kernels build); ValueError if the one asked for cannot run here."""
    device = flags.device_type
    if flags.attention_backend != "auto":
        backend = flags.attention_backend
        registry.check_backend(backend, device)
        if backend == "cpu-native" and not machine.kernels:
            raise ValueError(
                "attention backend cpu-native: its kernel cannot be built here (see the log); use cpu"
            )
        return Choice(backend, f"--attention-backend {backend}")
    if device != "cpu":
        backend = registry.DEVICE_DEFAULTS[device]
        registry.check_backend(backend, device)
        return Choice(backend, f"the {device} device's own backend")
    if flags.dtype_name != "float32":
        # NOTE: transformers' SDPA rounds the softmax to bfloat16 before multiplying the values, the native
        # kernel keeps float32, and at bfloat16's frequent near-ties greedy tokens then differ from
        # transformers' generate.
        return Choice("cpu", f"{flags.dtype_name} weights: the cpu backend's SDPA rounds as transformers")
    if not machine.kernels:
        return Choice("cpu", "the native kernels cannot be built here (see the log)")
    return Choice("cpu-native", "float32 weights with the native kernels built: K/V read in place, no gather")


def _attention_reason(attention: Choice, machine: Machine) -> str:
    if attention.implementation == "cpu-native" and machine.isa in ("AVX-512", "AMX"):
        return f"{attention.reason}; float K/V of head dim 64 in blocks of 16 scored by 16-float vectors"
    return attention.reason


def layer_forward(config: PretrainedConfig, flags: Flags) -> Choice:
    """The layers' forward: compute_service.fused's where it supports the architecture, else transformers'."""
    if not flags.fused:
        return Choice(TRANSFORMERS, "--unfused")
    misfit = fused.misfit(config, flags.dtype)
    if misfit is not None:
        return Choice(TRANSFORMERS, misfit)
    return Choice(FUSED, "fused QKV and gate/up products, one residual stream, no kwargs plumbing per layer")


def decode_layers(
    config: PretrainedConfig,
    layers: Choice,
    backend: str,
    decoder: LinearChoice,
    flags: Flags,
    machine: Machine,
) -> Choice:
    """The forward of all-decode steps: the native stack where it runs this model, else `layers`'."""
    kv_dtype = flags.kv_dtype_name
    misfit = None
    if layers.implementation != FUSED:
        misfit = "the native decode stack runs the fused layers only"
    elif config.model_type not in native_decode.ARCHITECTURES:
        names = ", ".join(native_decode.ARCHITECTURES)
        misfit = f"the native decode stack computes fused {names} layers only"
    elif backend != "cpu-native" or not machine.kernels:
        misfit = "the native decode stack calls the cpu-native attention and needs the native kernels"
    elif decoder.kernel not in (PANELS, ONEDNN):
        misfit = f"{decoder.implementation} linears: the native decode stack takes panels or oneDNN's"
    elif kv_dtype not in NATIVE_STACK_POOLS:
        misfit = f"a {kv_dtype} pool: the native decode stack stores K/V as float32 or bfloat16 only"
    if misfit is not None:
        return Choice(layers.implementation, misfit)
    return Choice(
        NATIVE_STACK,
        "every layer of an all-decode step in C++, no Python between the small ops; the other steps take its "
        "RMSNorm, rotary and SiLU·up",
    )


def linears(flags: Flags, weights: str, machine: Machine) -> tuple[LinearChoice, LinearChoice]:
    """The decoder layers' and the output head's linears under the resolved `weights` mode."""
    dense = dense_linears(flags, weights, machine)
    if weights not in QUANTIZED_MODES:
        return dense, dense
    model_dense = dense_linears(flags, flags.dtype_name, machine)
    head = quantized_linears(HEAD_MODE, flags, machine, model_dense)
    head = replace(head, reason=f"the output head is {HEAD_MODE} under --weights {weights}; {head.reason}")
    return quantized_linears(weights, flags, machine, model_dense), head


def dense_linears(flags: Flags, weights: str, machine: Machine) -> LinearChoice:
    """Linears on dense `weights` (the dtype, or bfloat16 in a float32 model)."""
    dtype = flags.dtype_name
    if flags.device_type != "cpu":
        return LinearChoice(TRANSFORMERS, dtype, f"nn.Linear on {flags.device}")
    if flags.plain_linear:
        return LinearChoice(TRANSFORMERS, dtype, "--plain-linear")
    if (dtype, weights) == MIXED_PRECISION:
        return LinearChoice(ONEDNN, weights, "--weights bfloat16: oneDNN's bfloat16 products, float32 sums")
    if dtype != "float32":
        return LinearChoice(TRANSFORMERS, dtype, f"{dtype}'s F.linear is oneDNN, rounded as transformers")
    if machine.kernels:
        return LinearChoice(PANELS, "float32", "each weight streamed once, prefetched ahead of its use")
    if machine.onednn:
        return LinearChoice(ONEDNN, "float32", "the native kernels cannot be built here: oneDNN, packed once")
    return LinearChoice(TRANSFORMERS, dtype, "neither the native kernels nor oneDNN here")


def quantized_linears(mode: str, flags: Flags, machine: Machine, dense: LinearChoice) -> LinearChoice:
    """Linears on `mode` (int8 or int4) weights; `dense` is how a float copy would run."""
    if flags.dtype_name == "float32" and machine.kernels:
        return LinearChoice(PANELS, mode, "every batch size, float32 activations, no dense copy")
    large = dense if dense.kernel != TRANSFORMERS else LinearChoice(DENSE, dense.weights, dense.reason)
    return LinearChoice(
        WEIGHT_ONLY,
        mode,
        "torch's weight-only kernel on decode-sized batches, the dequantised weights' product on larger",
        max_rows=QUANTIZED_MAX_ROWS,
        dense=large,
    )


def greedy(flags: Flags, machine: Machine) -> Choice:
    """A plain greedy batch's choice: the native kernel on the cpu where it builds, else torch's ops."""
    if flags.device_type != "cpu":
        return Choice(TORCH, f"the model runs on {flags.device}")
    if not machine.kernels:
        return Choice(TORCH, "the native kernels cannot be built here")
    return Choice(NATIVE, "each row's maximum and sum of exponentials in two passes, no temporaries")
