"""Weight-only quantised linear layers (`--weights int8|int4`), quantised once at load time.

int8: one scale per output channel, symmetric (q in [-127, 127]). int4: asymmetric, one scale and zero point
per INT4_GROUP_SIZE inputs of an output channel.

int8 in a float32 model where the native kernels build: the int8 weight is packed into panels
(compute_service/kernels/panel_linear.cpp) that every batch size multiplies by, with float32
activations, widening each weight to float32 in registers. It needs no dense copy: one step's linears of
SmolLM2-135M (30 layers, 2 threads, Xeon with AVX-512, best of 7) took 3.8 / 13.4 / 44 / 345 ms at 1 / 16 /
64 / 512 rows, against float32 panels' 17.1 / 26.2 / 52 / 326 and torch's int8 kernel's 9.9 / 34.2 / 97 /
708.

Otherwise (int4, a bfloat16 model, no native build): small batches (at most QUANTIZED_MAX_ROWS rows: decode
steps) run torch's CPU weight-only kernels on bfloat16 activations; larger ones (prefill) run a dense linear
(an nn.Linear child, `dense`, which compute_service.linear's packing reaches too) on the dequantised weights
in the model's dtype, so both paths multiply by the same (quantised) values.

NOTE: torch's kernels vectorise bfloat16 activations only; with float32 ones they take a scalar path
(measured ~4x slower at 1 row, ~30x at 16), so the input is cast to bfloat16 and the output back to the
model's dtype. Above ~16 rows the dense GEMM is faster than either kernel, which is why the dense weights are
kept: they cost the model's dtype per weight on top of the quantised copy.
"""

import torch
from torch import nn

from compute_service import kernels

WEIGHTS_CHOICES = ("auto", "float32", "bfloat16", "int8", "int4")
QUANTIZED_MODES = ("int8", "int4")
# (--dtype, --weights) of the mixed-precision mode: bfloat16 linears, everything else float32.
MIXED_PRECISION = ("float32", "bfloat16")
# Inputs sharing one int4 scale and zero point (the kernel accepts 32, 64, 128, 256; 32 is the most exact).
INT4_GROUP_SIZE = 32
# The int4 packing needs whole tiles of output channels.
INT4_ROW_MULTIPLE = 16
# The output head's mode under either quantised mode. NOTE: measured on SmolLM2-135M (cli/weights_report.py),
# int4 decoder layers change perplexity by -0.2 % with a dense head but +3.7 % with an int4 head; an int8
# head costs +0.1 %, at a quarter of float32's bytes.
HEAD_MODE = "int8"
# Rows up to which the quantised kernel runs; above, the dense GEMM (see the module docstring).
QUANTIZED_MAX_ROWS = 16
KERNEL_DTYPE = torch.bfloat16


def resolve_weights(weights: str, dtype: str) -> str:
    """The linear layers' weights: `auto` is the model's (resolved) `dtype`; a dense dtype name is that
    dtype, or bfloat16 in a float32 model (MIXED_PRECISION: compute_service.linear); ValueError for another
    dense dtype or an unknown mode."""
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


class QuantizedLinear(nn.Module):
    """y = x·Wᵀ + b with W held quantised (`mode` int8 or int4): as int8 panels (`panels`, see the module
    docstring) or for torch's kernels, with a dense copy for large batches. Equal to F.linear on the
    dequantised weights up to rounding (of the activations to bfloat16, on torch's kernels)."""

    def __init__(self, linear: nn.Linear, mode: str, kernel_max_rows: int = QUANTIZED_MAX_ROWS) -> None:
        super().__init__()
        assert mode in QUANTIZED_MODES, mode
        self.mode = mode
        self.kernel_max_rows = kernel_max_rows
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        weight = linear.weight.detach().float()
        dense_float32 = linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"
        module = kernels.load() if mode == "int8" and dense_float32 else None
        self.panels = module is not None
        dequantized = self._set_int8(weight) if mode == "int8" else self._set_int4(weight)
        if self.panels:
            self.qweight, self.scales = module.pack_panels(self.qweight), self.scales.float()
            return
        # The dense GEMM: the values the kernel multiplies by, in the model's dtype.
        self.dense = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        self.dense.weight = nn.Parameter(dequantized.to(linear.weight.dtype), requires_grad=False)
        self.dense.bias = linear.bias

    def _set_int8(self, weight: torch.Tensor) -> torch.Tensor:
        """Holds the int8 weight and its per-channel scales; returns the dequantised float32 weight."""
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        scales = scales.to(KERNEL_DTYPE).float()
        qweight = torch.round(weight / scales[:, None]).clamp(-127, 127)
        self.register_buffer("qweight", qweight.to(torch.int8))
        self.register_buffer("scales", scales.to(KERNEL_DTYPE))
        return qweight * scales[:, None]

    def _set_int4(self, weight: torch.Tensor) -> torch.Tensor:
        """Holds the packed int4 weight and its per-group scales and zero points; returns the dequantised
        float32 weight."""
        groups = weight.reshape(self.out_features, -1, INT4_GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(KERNEL_DTYPE).float()
        # NOTE: the kernel dequantises level q as (q - 8) * scale + zero, so zero = low + 8 * scale.
        zeros = (low + 8 * scales).to(KERNEL_DTYPE).float()
        levels = torch.round((groups - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15)
        packed = torch._convert_weight_to_int4pack_for_cpu(levels.flatten(1).to(torch.int32), 1)
        self.register_buffer("qweight", packed)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales", scales_and_zeros.to(KERNEL_DTYPE))
        return ((levels - 8) * scales[..., None] + zeros[..., None]).flatten(1)

    def uses_kernel(self, rows: int) -> bool:
        """Whether an input of `rows` rows takes the quantised kernel (else the dense GEMM): always on
        panels, else at most `kernel_max_rows` (QUANTIZED_MAX_ROWS unless the quality report searches the
        crossover)."""
        return self.panels or rows <= self.kernel_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.panels:
            flat = x.reshape(rows, self.in_features).contiguous()
            out = kernels.load().panel_linear(flat, self.qweight, self.out_features, self.bias, self.scales)
            return out.view(*x.shape[:-1], self.out_features)
        if not self.uses_kernel(rows):
            return self.dense(x)
        flat = x.reshape(rows, self.in_features).to(KERNEL_DTYPE)
        if self.mode == "int8":
            out = torch._weight_int8pack_mm(flat, self.qweight, self.scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(flat, self.qweight, INT4_GROUP_SIZE, self.scales)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kind = ", native panels" if self.panels else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{kind}"


def check_quantizable(name: str, linear: nn.Linear, mode: str) -> None:
    """ValueError naming the layer if the int4 kernel cannot hold its shape."""
    if mode != "int4":
        return
    if linear.in_features % INT4_GROUP_SIZE or linear.out_features % INT4_ROW_MULTIPLE:
        raise ValueError(
            f"--weights int4 needs in_features divisible by {INT4_GROUP_SIZE} and out_features by "
            f"{INT4_ROW_MULTIPLE}; layer {name!r} is {linear.out_features} x {linear.in_features}: "
            "use --weights int8"
        )


def quantize_linears(
    model: nn.Module, mode: str, lm_head: bool = True, kernel_max_rows: int = QUANTIZED_MAX_ROWS
) -> int:
    """Replaces every nn.Linear (fused projections too) of the model in place by a QuantizedLinear in
    `mode`; the output head only if `lm_head`, and in HEAD_MODE. Returns how many were replaced; a dense
    `mode` replaces none; `kernel_max_rows`: see QuantizedLinear.uses_kernel. ValueError (before any
    replacement) if a layer's shape does not fit the kernel."""
    if mode not in QUANTIZED_MODES:
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and not isinstance(parent, QuantizedLinear)
        and (lm_head or child is not head)
    ]
    modes = [HEAD_MODE if child is head else mode for _, _, child in targets]
    for (parent, name, child), child_mode in zip(targets, modes, strict=True):
        check_quantizable(f"{type(parent).__name__}.{name}", child, child_mode)
    for (parent, name, child), child_mode in zip(targets, modes, strict=True):
        setattr(parent, name, QuantizedLinear(child, child_mode, kernel_max_rows))
    return len(targets)
