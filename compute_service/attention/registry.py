"""Attention backends by name; one module per device, each with the pool dtypes it reads and writes, the
devices it runs on and how it attends. Which one runs is the execution plan's choice
(compute_service.planning)."""

from collections.abc import Callable

from compute_service.architectures import LayerAttention
from compute_service.attention import cpu, cpu_native, cuda, npu, npu_args
from compute_service.attention.backend_names import BACKEND_NAMES

BACKENDS: dict[str, Callable] = {
    "cpu": cpu.paged_attention,
    "cpu-native": cpu_native.paged_attention,
    "cuda": cuda.paged_attention,
    "npu": npu.paged_attention,
}
assert tuple(BACKENDS) == BACKEND_NAMES, "each name the flags accept is a backend"
KV_DTYPES: dict[str, tuple[str, ...]] = {
    "cpu": cpu.KV_DTYPES,
    "cpu-native": cpu_native.KV_DTYPES,
    "cuda": cuda.KV_DTYPES,
    "npu": npu.KV_DTYPES,
}
# The devices each backend runs on (cuda's torch path also runs on the cpu: its arguments checked there);
# a backend not listed runs on the cpu only.
DEVICES: dict[str, tuple[str, ...]] = {"cpu": ("cpu",), "cuda": cuda.DEVICES, "npu": npu.DEVICES}
# The block sizes each backend pages by are multiples of these (checked when a pool is attached); a
# backend not listed pages by any.
BLOCK_MULTIPLES: dict[str, int] = {"cpu": 1, "cuda": 1, "npu": npu_args.PREFILL_BLOCK_MULTIPLE}
# The backends that soft-cap attention scores (Gemma 2); every backend serves sliding windows.
SOFTCAP = ("cpu", "cpu-native", "cuda")
# --attention-backend auto off the cpu: the device's own backend (on the cpu: compute_service.planning).
DEVICE_DEFAULTS: dict[str, str] = {"cpu": "cpu", "cuda": "cuda", "npu": "npu"}
# How each backend attends (prompts and chunks, decodes), as the execution plan reports it.
PATHS: dict[str, tuple[str, str]] = {
    "cpu": (
        "causal SDPA per sequence, a cached prefix's blocks gathered",
        "one gather by block table and SDPA per group of equal context lengths",
    ),
    "cpu-native": ("the native kernel, K/V read in place by block table",) * 2,
    "cuda": ("flash_attn's varlen kernel with block_table where installed, else its torch path",) * 2,
    "npu": ("npu_fused_infer_attention_score over the packed step",) * 2,
}


def get_backend(name: str) -> Callable:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def check_backend(name: str, device_type: str) -> None:
    """ValueError unless the backend exists, runs on `device_type` and has its modules (torch_npu)."""
    get_backend(name)
    devices = DEVICES.get(name, ("cpu",))
    if device_type not in devices:
        raise ValueError(
            f"attention backend {name!r} runs on {' or '.join(devices)}, not on {device_type}: "
            "choose --attention-backend auto or a --kv-device it runs on"
        )
    if name == "npu":
        npu.require_torch_npu()


def require_kv_dtype(backend: str, kv_dtype: str) -> None:
    """ValueError unless the backend reads and writes K/V stored in `kv_dtype`."""
    supported = KV_DTYPES[backend]
    if kv_dtype not in supported:
        raise ValueError(
            f"attention backend {backend!r} cannot store K/V as {kv_dtype}; "
            f"choose --kv-dtype auto or one of {', '.join(supported)}"
        )


def require_block_size(backend: str, block_size: int) -> None:
    """ValueError unless the backend pages K/V by blocks of `block_size` tokens."""
    if block_size % BLOCK_MULTIPLES.get(backend, 1):
        npu_args.require_block_size(block_size)


def require_attention(backend: str, layers: tuple[LayerAttention, ...]) -> None:
    """ValueError unless the backend attends as the model's layers do: windows everywhere, soft-capped
    scores only where SOFTCAP says (the npu's fused op has no soft-cap)."""
    caps = sorted({layer.softcap for layer in layers if layer.softcap})
    if caps and backend not in SOFTCAP:
        raise ValueError(
            f"attention backend {backend!r} cannot soft-cap attention scores, which this model does (softcap "
            f"{caps[0]}): choose --attention-backend {' or '.join(SOFTCAP)}"
        )
