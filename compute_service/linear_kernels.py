"""The kernels a linear layer multiplies by (compute_service.linear), each holding its weight once, in the
layout it reads: x [rows, in] (+ bias) -> [rows, out]. Which one a layer gets is the execution plan's choice
(compute_service.planning); docs/internals/cpu-fast-path.md and quantised-weights.md have the measurements
behind each choice and the commands that take them again (`python -m tests.step_bench --compare linear`,
`python -m cli.weights_report --speed`).

- Panels: the native panel kernel (compute_service/kernels/panel_linear.cpp) on float32 weights, int8 ones
  with a float32 scale per output channel, or int4 ones with a scale and a zero point per group, widened in
  registers; float32 activations.
- OneDnn: oneDNN's inner product on a weight reordered once for PACK_ROWS rows, float32 or bfloat16 (mixed
  precision: the input cast to bfloat16, oneDNN sums in float32, the output cast back).
- WeightOnly: torch's int8/int4 weight-only kernels on bfloat16 activations up to `max_rows` rows (decode
  steps); above, another kernel (`dense`) on the dequantised weights in the model's dtype, so that both
  multiply by the same values.
- Dense: F.linear on a weight in the model's dtype (a WeightOnly's large batches where nothing is packed).
"""

import torch
import torch.nn.functional as F
from torch import nn

from compute_service import kernels
from compute_service.quantized import KERNEL_DTYPE, Quantized
from compute_service.weight_modes import INT4_GROUP_SIZE

# The batch size oneDNN's reordered weight layout is chosen for: 32 was faster than 1 from 1 row to 512.
PACK_ROWS = 32


class LinearKernel(nn.Module):
    """The kernels' base: each one's forward takes x [rows, in] and the layer's bias (or None) and returns
    x·Wᵀ (+ bias) [rows, out]."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features


class Panels(LinearKernel):
    """The native panel kernel on `packed` panels of `out_features` columns and `in_features` inputs: float32
    (`scales` None), int8 with `scales` [out], or int4 with its groups' scales and zero points (see
    `float32` and `quantized`)."""

    def __init__(
        self, in_features: int, out_features: int, packed: torch.Tensor, scales: torch.Tensor | None
    ):
        super().__init__(in_features, out_features)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    @classmethod
    def float32(cls, weight: torch.Tensor) -> "Panels":
        """Panels of a float32 weight [out, in]."""
        packed = _module().pack_panels(weight.detach().float().contiguous())
        return cls(weight.shape[1], weight.shape[0], packed, None)

    @classmethod
    def quantized(cls, quantized: Quantized) -> "Panels":
        """Panels of int8 or int4 levels, widened to float32 in registers as they are multiplied."""
        out_features, in_features = quantized.levels.shape
        if quantized.mode == "int8":
            packed, scales = _module().pack_panels(quantized.levels.contiguous()), quantized.scales.float()
        else:
            packed, scales = _module().pack_int4_panels(quantized.levels, quantized.scales, quantized.zeros)
        return cls(in_features, out_features, packed, scales.contiguous())

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernels.load().panel_linear(x.contiguous(), self.packed, self.out_features, bias, self.scales)

    def extra_repr(self) -> str:
        return f"{'int4' if self.packed.dtype == torch.uint8 else self.packed.dtype} panels"


def _module():
    module = kernels.load()
    assert module is not None, "the plan chose panels where the native kernels load"
    return module


class OneDnn(LinearKernel):
    """oneDNN's inner product on `weight` reordered once, held in `dtype` (float32 or bfloat16)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__(weight.shape[1], weight.shape[0])
        assert dtype in (torch.float32, torch.bfloat16), dtype
        self.dtype = dtype
        # NOTE: an opaque tensor (no views, no storage), so an attribute rather than a buffer.
        dense = weight.detach().to(dtype).contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, PACK_ROWS)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.dtype == x.dtype:
            return _onednn_linear(x, self.packed, bias)
        out = _onednn_linear(x.to(self.dtype), self.packed, None).to(x.dtype)
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return f"onednn {self.dtype}"


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Dense(LinearKernel):
    """F.linear on `weight` [out, in] as given."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight.shape[1], weight.shape[0])
        self.register_buffer("weight", weight.detach())

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


class WeightOnly(LinearKernel):
    """torch's weight-only kernel of `quantized`'s mode up to `max_rows` rows, `dense` above."""

    def __init__(self, quantized: Quantized, max_rows: int, dense: LinearKernel) -> None:
        super().__init__(dense.in_features, dense.out_features)
        self.mode, self.max_rows, self.dense = quantized.mode, max_rows, dense
        qweight, scales = quantized.for_torch()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def uses_kernel(self, rows: int) -> bool:
        """Whether an input of `rows` rows takes the quantised kernel (else `dense`)."""
        return rows <= self.max_rows

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.uses_kernel(len(x)):
            return self.dense(x, bias)
        flat = x.to(KERNEL_DTYPE)
        if self.mode == "int8":
            out = torch._weight_int8pack_mm(flat, self.qweight, self.scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(flat, self.qweight, INT4_GROUP_SIZE, self.scales)
        out = out.to(x.dtype)
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return f"{self.mode} up to {self.max_rows} rows"
