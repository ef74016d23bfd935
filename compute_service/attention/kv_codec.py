"""How K/V are stored in a pool whose dtype is not the compute dtype (--kv-dtype), and read back.

A write quantizes to the pool's dtype: a rounding cast for float32/bfloat16/float16; for fp8, a division by
the layer's scale, a clamp to the format's largest finite value (saturation, never inf or NaN) and a
round-to-nearest cast. A read upcasts to the compute dtype and, for fp8, multiplies by the scale. With the
pool in the compute dtype both are no-ops: the default path is unchanged.
"""

import hashlib
import struct
from dataclasses import dataclass

import torch

from common.shared_pool import is_fp8

# Pool dtypes whose range is far below float32's: a write clamps to their largest finite value.
_SATURATE_BELOW = 2.0**17


@dataclass(frozen=True)
class KVScales:
    """Per-layer scales of K and of V for an fp8 pool (stored = value / scale); empty for other dtypes."""

    k: tuple[float, ...] = ()
    v: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.k) == len(self.v), "one K and one V scale per layer"
        assert all(s > 0 for s in (*self.k, *self.v)), "scales are positive"

    @property
    def identity(self) -> str:
        """A digest of the exact scales ("" without scales): equal only for bit-identical scales."""
        if not self.k:
            return ""
        data = struct.pack(f"<{2 * len(self.k)}d", *self.k, *self.v)
        return hashlib.sha256(data).hexdigest()[:16]

    def of_layer(self, layer: int) -> tuple[float, float]:
        """(K scale, V scale) of one layer; 1.0 each without scales."""
        return (self.k[layer], self.v[layer]) if self.k else (1.0, 1.0)


NO_SCALES = KVScales()


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the pool of `dtype` stores it."""
    if x.dtype == dtype:
        assert scale == 1.0, "a pool in the compute dtype is never scaled"
        return x
    if scale != 1.0:
        x = x / scale
    if torch.finfo(dtype).max < _SATURATE_BELOW:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Stored entries x back in the compute `dtype`."""
    if x.dtype == dtype:
        return x
    out = x.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


def round_trip(x: torch.Tensor, pool_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x exactly as a read of the pool would return it after a write of x."""
    return dequantize(quantize(x, pool_dtype, scale), x.dtype, scale)


def store(rows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
    """Writes x [T, Hkv, D] quantized into rows [slots of the pool, Hkv, D] at `slots`."""
    stored = quantize(x, rows.dtype, scale)
    if is_fp8(rows.dtype):
        # NOTE: index_copy_ has no fp8 kernel on the CPU; copying the bytes is the same write.
        rows.view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))
    else:
        rows.index_copy_(0, slots, stored)
