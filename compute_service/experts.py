"""Mixture-of-experts layers on the plan's linear kernels: each expert's projections held by the kernel the
plan chose for the decoder's linears (`linears.decoder`), the tokens of a step grouped by expert with one
sort and one host read, instead of transformers' one-hot mask, `nonzero` and per-expert `where`.

transformers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) keeps a layer's experts in one module of 3-D weights,
`gate_up_proj` [experts, 2 x intermediate, hidden] and `down_proj` [experts, hidden, intermediate], called
with each token's top-k expert ids and routing weights; the router and any shared expert stay transformers'
(a shared expert's nn.Linear layers are replaced like every other)."""

import torch
from torch import nn

from compute_service.linear import kernel_for
from compute_service.plan import LinearChoice


class PackedExperts(nn.Module):
    """One layer's experts as transformers computes them, each projection on its own kernel."""

    def __init__(self, experts: nn.Module, choice: LinearChoice) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        self.gate_up = nn.ModuleList(kernel_for(w, choice) for w in experts.gate_up_proj.detach().unbind(0))
        self.down = nn.ModuleList(kernel_for(w, choice) for w in experts.down_proj.detach().unbind(0))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states [tokens, hidden]; top_k_index and top_k_weights [tokens, k]: the sum over each
        token's k experts of weight × down(act(gate) × up)."""
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[1]
        experts = top_k_index.flatten()
        order = experts.argsort(stable=True)
        counts = torch.bincount(experts, minlength=self.num_experts).tolist()
        tokens, weights = order // k, top_k_weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            gate, up = self.gate_up[expert](hidden_states[rows], None).chunk(2, dim=-1)
            expert_out = self.down[expert](self.act_fn(gate) * up, None)
            out.index_add_(0, rows, (expert_out * weights[start : start + count, None]).to(out.dtype))
            start += count
        return out


def packable(module: nn.Module) -> bool:
    """Whether `module` is a transformers experts module of the layout PackedExperts computes."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == down.dim() == 3
        and hasattr(module, "act_fn")
        and not getattr(module, "has_bias", False)
        and not getattr(module, "is_transposed", False)
        and gate_up.shape[2] == down.shape[1]
        and gate_up.shape[1] == 2 * down.shape[2]
    )


def pack_experts(model: nn.Module, choice: LinearChoice) -> int:
    """Replaces every packable experts module of the model by a PackedExperts on `choice`'s kernel; returns
    how many it replaced."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if packable(child)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedExperts(child, choice))
    return len(targets)
