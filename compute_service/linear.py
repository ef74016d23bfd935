"""The one linear layer: y = x·Wᵀ + b through the kernel the execution plan chose for its shape class
(compute_service.linear_kernels), its weight held once by that kernel; the loader replaces a model's
nn.Linear layers by it (`replace_linears`) where the plan does not keep transformers' own."""

import torch
from torch import nn

from common.shared_pool import dtype_from_name
from compute_service.linear_kernels import Dense, LinearKernel, OneDnn, Panels, WeightOnly
from compute_service.plan import DENSE, ONEDNN, PANELS, TRANSFORMERS, WEIGHT_ONLY, LinearChoice
from compute_service.quantized import QUANTIZED_MODES, check_quantizable, quantize


class Linear(nn.Module):
    """y = x·Wᵀ + b on `kernel`; equal to F.linear on the weight the kernel holds, up to rounding. The bias
    stays the original layer's parameter; the plain weight is not kept (it lives on only where another
    module shares it, as a tied embedding does)."""

    def __init__(self, kernel: LinearKernel, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = kernel.in_features, kernel.out_features
        self.kernel = kernel
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel(x.reshape(-1, self.in_features), self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def kernel_for(weight: torch.Tensor, choice: LinearChoice) -> LinearKernel:
    """The kernel `choice` names, holding `weight` [out, in] (in the model's dtype) as it says."""
    if choice.weights in QUANTIZED_MODES:
        quantized = quantize(weight, choice.weights)
        if choice.kernel == PANELS:
            return Panels.quantized(quantized)
        assert choice.kernel == WEIGHT_ONLY and choice.dense is not None, choice
        dense = kernel_for(quantized.dequantized.to(weight.dtype), choice.dense)
        return WeightOnly(quantized, choice.max_rows, dense)
    if choice.kernel == PANELS:
        return Panels.float32(weight)
    if choice.kernel == ONEDNN:
        return OneDnn(weight, dtype_from_name(choice.weights))
    assert choice.kernel == DENSE, choice
    return Dense(weight)


def replace_linears(model: nn.Module, decoder: LinearChoice, head: LinearChoice) -> int:
    """Replaces every nn.Linear of the model in place (fused projections too) by a Linear as `decoder` says,
    the output head as `head` says; a TRANSFORMERS choice keeps those as they are. Returns how many were
    replaced. ValueError (before any replacement) if a layer's shape does not fit its kernel. Run it after
    fusing: fusing stacks the plain weights this hides."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [
        (parent, name, child, head if child is output else decoder)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    targets = [target for target in targets if target[3].kernel != TRANSFORMERS]
    for parent, name, child, choice in targets:
        check_quantizable(
            f"{type(parent).__name__}.{name}", child, choice.weights, choice.kernel == WEIGHT_ONLY
        )
    for parent, name, child, choice in targets:
        setattr(parent, name, Linear(kernel_for(child.weight, choice), child.bias))
    return len(targets)
