"""Attention backends by name; one module per device."""

from collections.abc import Callable

from compute_service.attention import cpu

BACKENDS: dict[str, Callable] = {"cpu": cpu.paged_attention}


def get_backend(name: str) -> Callable:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]
