"""Weight-only quantisation (`--weights int8|int4`), done once at load time; the linears that multiply by the
quantised weights are compute_service.linear's, as the execution plan (compute_service.plan) says.

int8: one scale per output channel, symmetric (q in [-127, 127]). int4: asymmetric, one scale and zero point
per INT4_GROUP_SIZE inputs of an output channel. Scales and zero points are rounded to bfloat16, the dtype
torch's weight-only kernels take them in, so every path multiplies by the same dequantised values.
"""

from dataclasses import dataclass

import torch
from torch import nn

from compute_service.weight_modes import INT4_GROUP_SIZE, WEIGHTS_CHOICES

QUANTIZED_MODES = ("int8", "int4")
# (--dtype, --weights) of the mixed-precision mode: bfloat16 linears, everything else float32.
MIXED_PRECISION = ("float32", "bfloat16")
# torch's int4 packing needs whole tiles of output channels.
INT4_ROW_MULTIPLE = 16
# The output head's mode under either quantised mode. NOTE: an int4 head costs far more perplexity than int4
# decoder layers, an int8 head little, at a quarter of float32's bytes (docs/configuration.md, Quantised
# weights; `python -m cli.weights_report --dense-head` measures it).
HEAD_MODE = "int8"
# Rows up to which torch's weight-only kernels run; above, the dense GEMM on the dequantised weights is
# faster (docs/internals/quantised-weights.md).
QUANTIZED_MAX_ROWS = 16
# The activations' dtype on torch's weight-only kernels. NOTE: they vectorise bfloat16 activations only;
# float32 ones take a scalar path, many times slower (docs/internals/kernels.md), so the input is cast to
# bfloat16 and the output back.
KERNEL_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Quantized:
    """A weight [out, in] quantised: `levels` [out, in], int8 levels in [-127, 127] or int4 ones in [0, 15]
    (uint8, level q standing for (q - 8) * scale + zero); `scales` int8's per-channel scales [out] or int4's
    per-group ones [out, groups], `zeros` int4's zero points [out, groups] (None for int8), bfloat16 values
    held as float32; `dequantized` the float32 values every path multiplies by."""

    mode: str
    levels: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    dequantized: torch.Tensor

    def for_torch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight and scales in the layout torch's weight-only kernel of this mode takes: int8 levels and
        bfloat16 scales [out]; int4 levels packed by torch and bfloat16 scales and zeros [groups, out, 2]."""
        if self.mode == "int8":
            return self.levels, self.scales.to(KERNEL_DTYPE)
        packed = torch._convert_weight_to_int4pack_for_cpu(self.levels.to(torch.int32), 1)
        scales_and_zeros = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous()
        return packed, scales_and_zeros.to(KERNEL_DTYPE)


def quantize(weight: torch.Tensor, mode: str) -> Quantized:
    """`weight` [out, in] quantised in `mode` (int8 or int4)."""
    assert mode in QUANTIZED_MODES, mode
    weight = weight.detach().float()
    return _int8(weight) if mode == "int8" else _int4(weight)


def _int8(weight: torch.Tensor) -> Quantized:
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    scales = scales.to(KERNEL_DTYPE).float()
    levels = torch.round(weight / scales[:, None]).clamp(-127, 127)
    return Quantized("int8", levels.to(torch.int8), scales, None, levels * scales[:, None])


def _int4(weight: torch.Tensor) -> Quantized:
    groups = weight.reshape(weight.shape[0], -1, INT4_GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(KERNEL_DTYPE).float()
    # NOTE: the kernels dequantise level q as (q - 8) * scale + zero, so zero = low + 8 * scale.
    zeros = (low + 8 * scales).to(KERNEL_DTYPE).float()
    levels = torch.round((groups - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15)
    dequantized = ((levels - 8) * scales[..., None] + zeros[..., None]).flatten(1)
    return Quantized("int4", levels.flatten(1).to(torch.uint8), scales, zeros, dequantized)


def resolve_weights(weights: str, dtype: str) -> str:
    """The linear layers' weights: `auto` is the model's (resolved) `dtype`; a dense dtype name is that
    dtype, or bfloat16 in a float32 model (MIXED_PRECISION); ValueError for another dense dtype or an
    unknown mode."""
    if weights not in WEIGHTS_CHOICES:
        raise ValueError(f"unknown --weights {weights!r}: choose one of {', '.join(WEIGHTS_CHOICES)}")
    if weights == "auto" or weights in QUANTIZED_MODES:
        return dtype if weights == "auto" else weights
    if weights != dtype and (dtype, weights) != MIXED_PRECISION:
        raise ValueError(
            f"--weights {weights} with --dtype {dtype}: dense weights run in the model's dtype, or in "
            f"bfloat16 in a float32 model; pass --dtype {weights}, or --weights auto|int8|int4"
        )
    return weights


def check_quantizable(name: str, linear: nn.Linear, mode: str, whole_tiles: bool) -> None:
    """ValueError naming the layer if int4 cannot hold its shape: its inputs must make whole groups, and with
    `whole_tiles` (torch's int4 kernel) its outputs whole tiles too."""
    if mode != "int4":
        return
    if linear.in_features % INT4_GROUP_SIZE or (whole_tiles and linear.out_features % INT4_ROW_MULTIPLE):
        outputs = f" and out_features by {INT4_ROW_MULTIPLE}" if whole_tiles else ""
        raise ValueError(
            f"--weights int4 needs in_features divisible by {INT4_GROUP_SIZE}{outputs}; layer {name!r} is "
            f"{linear.out_features} x {linear.in_features}: use --weights int8"
        )
