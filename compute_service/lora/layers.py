"""The model's LoRA targets: each decoder layer's q/k/v/o and gate/up/down projections (or the fused QKV and
gate/up linears that hold them) wrapped once, at load, by a LoraLinear that adds each row's own adapter.

A step's rows are grouped by adapter once (`StepRows`, set by the runner for the step); every wrapped
linear then runs its base product over all rows, and for each adapter in the step one shrink (x·Aᵀ over
that adapter's rows together) and one expand (·Bᵀ, added into those rows of the output): the segmented
shrink/expand of punica and S-LoRA, a product per adapter in the step, never a model copy or a step per
adapter. A fused projection's adapter is its targets' A stacked and their B placed block-diagonally, so one
shrink and one expand serve q, k and v (or gate and up) together."""

from dataclasses import dataclass

import torch
from torch import nn

from compute_service.llama_layer import FusedLlamaLayer

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
TARGETS = ATTENTION + MLP


@dataclass(frozen=True)
class Site:
    """Where a target module of one layer lives: the LoraLinear holding it and its rows [start, end) of
    that linear's output (a fused projection holds several targets)."""

    linear: "LoraLinear"
    start: int
    end: int

    @property
    def shape(self) -> tuple[int, int]:
        """A target's weight shape [out, in]: what its lora_B [out, r] and lora_A [r, in] must fit."""
        return self.end - self.start, self.linear.in_features


@dataclass(frozen=True)
class StepRows:
    """A step's token rows grouped by adapter: (adapter id, its rows: a slice when they are contiguous,
    else their indices), base rows left out."""

    groups: tuple[tuple[int, slice | torch.Tensor], ...]

    @classmethod
    def of(cls, adapter_ids: torch.Tensor, cu_seqlens_q: torch.Tensor) -> "StepRows | None":
        """The rows of a step whose sequence i (tokens cu_seqlens_q[i]:[i + 1]) runs adapter_ids[i] (0: the
        base); None when every row is the base's."""
        if not bool(adapter_ids.any()):
            return None
        per_token = adapter_ids.repeat_interleave(cu_seqlens_q.diff())
        groups = []
        for adapter in adapter_ids.unique().tolist():
            if adapter == 0:
                continue
            rows = (per_token == adapter).nonzero().squeeze(1)
            first, last = int(rows[0]), int(rows[-1])
            groups.append((adapter, slice(first, last + 1) if last - first + 1 == len(rows) else rows))
        return cls(tuple(groups))


_ROWS: StepRows | None = None


def set_rows(rows: StepRows | None) -> None:
    global _ROWS
    _ROWS = rows


def current_rows() -> StepRows | None:
    """The running step's adapter rows (None: a step of base rows only)."""
    return _ROWS


class LoraLinear(nn.Module):
    """`base` (any linear module: packed, quantised or nn.Linear) plus, on each row of an adapter that
    targets it, that adapter's x·Aᵀ·Bᵀ (B scaled at load)."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int) -> None:
        super().__init__()
        self.base, self.in_features, self.out_features = base, in_features, out_features
        # adapter id -> (A [R, in], B [out, R]) in the base's dtype
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = _ROWS
        if rows is None or not self.adapters:
            return y
        flat_x, flat_y = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        for adapter, index in rows.groups:
            pair = self.adapters.get(adapter)
            if pair is None:
                continue
            a, b = pair
            # shrink: [rows, R]; expand: added to the adapter's rows of the output
            shrunk = flat_x[index] @ a.T
            if isinstance(index, slice):
                flat_y[index].addmm_(shrunk, b.T)
            else:
                flat_y.index_add_(0, index, shrunk @ b.T)
        return y

    def add(self, adapter: int, pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
        """Makes `adapter` resident here: pieces (start, end, A [r, in], B [end - start, r]) of the output
        rows each of its targets in this linear covers."""
        a = torch.cat([piece[2] for piece in pieces])
        b = a.new_zeros(self.out_features, len(a))
        rank = 0
        for start, end, _, piece_b in pieces:
            b[start:end, rank : rank + piece_b.shape[1]] = piece_b
            rank += piece_b.shape[1]
        self.adapters[adapter] = (a, b)

    def remove(self, adapter: int) -> None:
        self.adapters.pop(adapter, None)


def wrap_targets(model: nn.Module) -> dict[tuple[int, str], Site]:
    """Wraps every target linear of the model's decoder layers in a LoraLinear, in place; returns where
    each (layer, target module) is. Run it last at load: later passes over the linears would not see
    through the wrapper."""
    sites: dict[tuple[int, str], Site] = {}
    for index, layer in enumerate(model.model.layers):
        if isinstance(layer, FusedLlamaLayer):
            sites.update({(index, target): site for target, site in _fused_sites(layer).items()})
            continue
        for block_name, names in (("self_attn", ATTENTION), ("mlp", MLP)):
            block = getattr(layer, block_name, None)
            for name in names:
                base = getattr(block, name, None) if block is not None else None
                if base is None or not hasattr(base, "out_features"):
                    continue
                linear = LoraLinear(base, base.in_features, base.out_features)
                setattr(block, name, linear)
                sites[(index, name)] = Site(linear, 0, base.out_features)
    return sites


def _fused_sites(layer: FusedLlamaLayer) -> dict[str, Site]:
    """A fused layer's targets: q, k, v in its QKV projection, gate and up in its gate/up one."""
    q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    half = layer.gate_up_proj.out_features // 2
    layout = {
        "qkv_proj": {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)},
        "o_proj": {"o_proj": (0, layer.o_proj.out_features)},
        "gate_up_proj": {"gate_proj": (0, half), "up_proj": (half, 2 * half)},
        "down_proj": {"down_proj": (0, layer.down_proj.out_features)},
    }
    sites = {}
    for attr, targets in layout.items():
        base = getattr(layer, attr)
        linear = LoraLinear(base, base.in_features, base.out_features)
        setattr(layer, attr, linear)
        sites.update({name: Site(linear, *bounds) for name, bounds in targets.items()})
    return sites
