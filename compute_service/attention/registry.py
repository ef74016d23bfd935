"""Attention backends by name; one module per device, each with the pool dtypes it reads and writes."""

from collections.abc import Callable

from compute_service.attention import cpu, cpu_native, native

BACKENDS: dict[str, Callable] = {"cpu": cpu.paged_attention, "cpu-native": cpu_native.paged_attention}
KV_DTYPES: dict[str, tuple[str, ...]] = {"cpu": cpu.KV_DTYPES, "cpu-native": cpu_native.KV_DTYPES}


def default_backend(dtype: str = "float32") -> str:
    """For float32 weights, cpu-native where its kernel builds and loads (compute_service.attention.native);
    else cpu.

    NOTE: bfloat16 keeps cpu: transformers' SDPA rounds the softmax to bfloat16 before multiplying the values,
    the native kernel keeps float32, and at bfloat16's frequent near-ties greedy tokens then differ from
    transformers' generate (measured: the batched parity test left the reference at a gap of 0.125).
    """
    return "cpu-native" if dtype == "float32" and native.load() is not None else "cpu"


def get_backend(name: str) -> Callable:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def require_kv_dtype(backend: str, kv_dtype: str) -> None:
    """ValueError unless the backend reads and writes K/V stored in `kv_dtype`."""
    supported = KV_DTYPES[backend]
    if kv_dtype not in supported:
        raise ValueError(
            f"attention backend {backend!r} cannot store K/V as {kv_dtype}; "
            f"choose --kv-dtype auto or one of {', '.join(supported)}"
        )
