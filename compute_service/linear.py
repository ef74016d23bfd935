"""float32 linear layers on the CPU, each weight packed once at load time: into panels for the native
kernel (compute_service/kernels/panel_linear.cpp) where it builds, else into oneDNN's blocked layout.

NOTE: torch's float32 F.linear on the CPU is MKL's sgemm. oneDNN's inner product on a pre-reordered weight
was faster at every batch size measured, decode and prefill alike. One step's linears of SmolLM2-135M (30
layers + the output head, 538 MB of weights), 2 vCPUs, AMD EPYC with AVX-512, median of 9:
rows 1: 25-33 -> 11-15 ms; 16: 47-58 -> 20 ms; 64: 111-152 -> 50 ms; 512: ~800 -> 370 ms.
The reordered layout is tuned for PACK_ROWS rows; 32 was faster than 1 from 1 row to 512 (the layout for
one row was no faster than the plain weight). vLLM's CPU engine takes the same route (a oneDNN matmul
on a weight prepared once).

The native panels went further where a step streams the weights from memory (a decode step: every weight
read once, none in cache): the kernel prefetches each panel ahead of its arithmetic, which oneDNN's small
products did not overlap well (measurements in panel_linear.cpp). They take the oneDNN weight's place, not
a second copy.

bfloat16 linears in a float32 model (`--weights bfloat16`, mixed precision): the weight is reordered in
bfloat16, each input cast to bfloat16 and each output back to float32 (oneDNN accumulates in float32). On a
CPU with bfloat16 dot products (AVX512-BF16 or AMX), one step's linears as above, median of 10:
rows 1: 11.0 -> 6.5 ms; 16: 14.5 -> 10.9 ms; 64: 41 -> 26 ms; 512: 319 -> 171 ms. Without them
oneDNN emulates bfloat16 (~30x slower), so the mode is refused there (`bfloat16_native`).

Other dtypes and devices keep nn.Linear: bfloat16's F.linear is oneDNN already and its rounding is held
token for token against transformers.
"""

import torch
from torch import nn

from compute_service import kernels

# The batch size the reordered weight layout is chosen for (see the module docstring).
PACK_ROWS = 32


def can_pack(linear: nn.Module) -> bool:
    """Whether `linear` is a plain float32 CPU nn.Linear and this torch has oneDNN."""
    return (
        isinstance(linear, nn.Linear)
        and linear.weight.dtype == torch.float32
        and linear.weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
    )


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered for oneDNN's inner product (an opaque tensor: no views, no storage)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x·Wᵀ + b for a weight from `packed_weight`; x [..., in] float32, contiguous result [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """y = x·Wᵀ + b on `linear`'s weight packed once: float32 panels for the native kernel where it builds
    (`panels`), else reordered for oneDNN in `dtype` (float32, or bfloat16 for mixed precision: the input
    cast to it, the output back); equal to F.linear on the weight in `dtype` up to rounding.

    The bias stays `linear`'s own float32 parameter; the plain weight is not kept (it lives on only where
    another module shares it, as a tied embedding does)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        assert can_pack(linear), "PackedLinear takes a float32 CPU nn.Linear"
        assert dtype in (torch.float32, torch.bfloat16), dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = dtype
        module = kernels.load() if dtype == torch.float32 else None
        self.panels = module is not None
        weight = linear.weight.detach().to(dtype).contiguous()
        self.packed = module.pack_panels(weight) if module else packed_weight(weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels:
            rows = x.reshape(-1, self.in_features).contiguous()
            out = kernels.load().panel_linear(rows, self.packed, self.out_features, self.bias, None)
            return out.view(*x.shape[:-1], self.out_features)
        if self.dtype == x.dtype:
            return packed_linear(x, self.packed, self.bias)
        out = packed_linear(x.to(self.dtype), self.packed, None).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kind = "native panels" if self.panels else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind} {self.dtype}"


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Replaces every float32 CPU nn.Linear of the model in place by a PackedLinear holding its weight in
    `dtype`; returns how many. Run it last: passes that read or replace nn.Linear weights (fusing,
    quantising) no longer see these."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if can_pack(child)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, dtype))
    return len(targets)
