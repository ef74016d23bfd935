"""Attention backends by name; one module per device, each with the pool dtypes it reads and writes."""

from collections.abc import Callable

from compute_service.attention import cpu, cpu_native, native

BACKENDS: dict[str, Callable] = {"cpu": cpu.paged_attention, "cpu-native": cpu_native.paged_attention}
KV_DTYPES: dict[str, tuple[str, ...]] = {"cpu": cpu.KV_DTYPES, "cpu-native": cpu_native.KV_DTYPES}


def default_backend() -> str:
    """cpu-native where its kernel builds and loads (compute_service.attention.native), else cpu."""
    return "cpu-native" if native.load() is not None else "cpu"


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
