"""Attention backends by name; one module per device, each with the pool dtypes it reads and writes and
the devices it runs on. `auto` picks the device's own backend."""

from collections.abc import Callable

from compute_service import kernels
from compute_service.attention import cpu, cpu_native, cuda, npu, npu_args

BACKENDS: dict[str, Callable] = {
    "cpu": cpu.paged_attention,
    "cpu-native": cpu_native.paged_attention,
    "cuda": cuda.paged_attention,
    "npu": npu.paged_attention,
}
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
# --attention-backend auto: the backend of the device compute runs on (on the cpu, see default_backend).
DEVICE_DEFAULTS: dict[str, str] = {"cpu": "cpu", "cuda": "cuda", "npu": "npu"}


def default_backend(dtype: str = "float32", device_type: str = "cpu") -> str:
    """The device's own backend; on the cpu with float32 weights, cpu-native where its kernel builds and loads
    (compute_service.kernels).

    NOTE: bfloat16 keeps cpu: transformers' SDPA rounds the softmax to bfloat16 before multiplying the values,
    the native kernel keeps float32, and at bfloat16's frequent near-ties greedy tokens then differ from
    transformers' generate (measured: the batched parity test left the reference at a gap of 0.125).
    """
    if device_type == "cpu" and dtype == "float32" and kernels.load() is not None:
        return "cpu-native"
    return DEVICE_DEFAULTS[device_type]


def get_backend(name: str) -> Callable:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def backend_for(name: str, device_type: str, dtype: str = "float32") -> str:
    """The backend to run on `device_type` with `dtype` weights (`auto`: default_backend); ValueError if it
    cannot run there or needs a module that is not installed (torch_npu)."""
    backend = default_backend(dtype, device_type) if name == "auto" else name
    get_backend(backend)
    devices = DEVICES.get(backend, ("cpu",))
    if device_type not in devices:
        raise ValueError(
            f"attention backend {backend!r} runs on {' or '.join(devices)}, not on {device_type}: "
            "choose --attention-backend auto or a --kv-device it runs on"
        )
    if backend == "npu":
        npu.require_torch_npu()
    return backend


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
