"""Attention backends by name; one module per device, each with the pool dtypes it reads and writes and
the devices it runs on. `auto` picks the device's own backend."""

from collections.abc import Callable

from compute_service.attention import cpu, cuda, npu, npu_args

BACKENDS: dict[str, Callable] = {
    "cpu": cpu.paged_attention,
    "cuda": cuda.paged_attention,
    "npu": npu.paged_attention,
}
KV_DTYPES: dict[str, tuple[str, ...]] = {"cpu": cpu.KV_DTYPES, "cuda": cuda.KV_DTYPES, "npu": npu.KV_DTYPES}
# The devices each backend runs on (cuda's torch path also runs on the cpu: its arguments checked there);
# a backend not listed runs on the cpu only.
DEVICES: dict[str, tuple[str, ...]] = {"cpu": ("cpu",), "cuda": cuda.DEVICES, "npu": npu.DEVICES}
# The block sizes each backend pages by are multiples of these (checked when a pool is attached); a
# backend not listed pages by any.
BLOCK_MULTIPLES: dict[str, int] = {"cpu": 1, "cuda": 1, "npu": npu_args.PREFILL_BLOCK_MULTIPLE}
# --attention-backend auto: the backend of the device compute runs on.
DEVICE_DEFAULTS: dict[str, str] = {"cpu": "cpu", "cuda": "cuda", "npu": "npu"}


def get_backend(name: str) -> Callable:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def backend_for(name: str, device_type: str) -> str:
    """The backend to run on `device_type` (`auto`: the device's own); ValueError if it cannot run there
    or needs a module that is not installed (torch_npu)."""
    backend = DEVICE_DEFAULTS[device_type] if name == "auto" else name
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
