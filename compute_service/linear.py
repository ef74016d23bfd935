"""Linear layers for small float32 batches on the CPU: the product taken as W·xᵀ instead of x·Wᵀ.

NOTE: with few rows (decode steps), MKL's float32 GEMM runs x·Wᵀ far below its speed for W·xᵀ, the same
product with the operands' roles swapped. Measured on a 2-vCPU AVX2 machine, SmolLM2-135M, one decode step of
16 sequences: 334 -> 251 ms; 4 sequences: 180 -> 105 ms; the output projection (49,152 x 576) at 16 rows
54 -> 30 ms. From about 128 rows on (prefill) the two are even, so larger inputs keep nn.Linear's path, as do
other dtypes (bfloat16's small-batch kernel is faster as x·Wᵀ) and other devices.
"""

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 128


class SmallBatchLinear(nn.Linear):
    """nn.Linear whose forward on at most SMALL_BATCH_ROWS rows of a float32 CPU input computes W·xᵀ; the
    result is the transposed view of that product (no copy), equal to F.linear up to float rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > SMALL_BATCH_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        if self.bias is None:
            out = torch.mm(self.weight, flat.t())
        else:
            out = torch.addmm(self.bias[:, None], self.weight, flat.t())
        return out.t().reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def like(cls, linear: nn.Linear) -> "SmallBatchLinear":
        """A SmallBatchLinear holding `linear`'s own parameters (shared, so tied weights stay tied)."""
        fast = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        fast.weight = linear.weight
        fast.bias = linear.bias
        return fast


def use_small_batch_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear of the model in place by a SmallBatchLinear sharing its parameters; returns
    how many were replaced. The state dict keeps its keys and tensors."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, SmallBatchLinear.like(child))
                replaced += 1
    return replaced
