"""The model's LoRA targets: each decoder layer's q/k/v/o and gate/up/down projections (or the fused QKV and
gate/up linears that hold them) wrapped once, at load, by a LoraLinear that adds each row's own adapter.

A step's rows are grouped by adapter once (`StepRows`, set by the runner for the step); every wrapped
linear then runs its base product over all rows, then one shrink (x·Aᵀ) and one expand (·Bᵀ, added into
the rows of the output) batched over the adapters in the step, each adapter over its own rows: the
segmented shrink/expand of punica and S-LoRA, never a model copy or a step per adapter. A fused projection's
adapter is its targets' A stacked, so one shrink serves q, k and v (or gate and up) together, and one expand
per target writes its rows of the output."""

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
    piece: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        """A target's weight shape [out, in]: what its lora_B [out, r] and lora_A [r, in] must fit."""
        return self.end - self.start, self.linear.in_features


@dataclass(frozen=True)
class StepRows:
    """A step's token rows grouped by adapter slot, base rows left out: `slots` the groups' slots,
    ascending (a slice where they are consecutive, so that the stacked weights are read in place, not
    gathered); `groups` each group's (slot, its rows: a slice when contiguous, else their indices); and,
    when the groups padded to one length waste at most as many rows as they hold, `padded` [G, M] their rows
    (a short group repeats its first row) with `keep` the positions of real rows in the flattened [G * M]
    (None: no padding), and `block` those rows as one slice where they are consecutive, unpadded and in
    slot order (then read and updated in place)."""

    slots: slice | torch.Tensor
    groups: tuple[tuple[int, slice | torch.Tensor], ...]
    padded: torch.Tensor | None
    keep: torch.Tensor | None
    block: slice | None = None

    @classmethod
    def of(cls, slots: torch.Tensor, cu_seqlens_q: torch.Tensor) -> "StepRows | None":
        """The rows of a step whose sequence i (tokens cu_seqlens_q[i]:[i + 1]) runs the adapter in slot
        slots[i] (-1: the base); None when every row is the base's."""
        if not bool((slots >= 0).any()):
            return None
        per_token = slots.repeat_interleave(cu_seqlens_q.diff())
        used = per_token.unique()
        used = used[used >= 0]
        members = [(per_token == slot).nonzero().squeeze(1) for slot in used.tolist()]
        groups = tuple((slot, _span(rows)) for slot, rows in zip(used.tolist(), members, strict=True))
        longest, total = max(map(len, members)), sum(map(len, members))
        if longest * len(members) > 2 * total:
            return cls(used, groups, None, None)
        padded = torch.stack([torch.cat((rows, rows[:1].expand(longest - len(rows)))) for rows in members])
        keep = None
        if longest * len(members) != total:
            keep = torch.cat([torch.arange(len(rows)) + g * longest for g, rows in enumerate(members)])
        first, last = int(used[0]), int(used[-1])
        if last - first + 1 == len(used):
            used = slice(first, last + 1)
        flat, block = padded.view(-1), None
        if keep is None and bool((flat.diff() == 1).all()):
            block = slice(int(flat[0]), int(flat[-1]) + 1)
        return cls(used, groups, padded, keep, block)

    def to(self, device: torch.device) -> "StepRows":
        """The same rows with their index tensors on `device` (the model's)."""
        if device.type == "cpu":
            return self

        def moved(value):
            return value.to(device) if isinstance(value, torch.Tensor) else value

        groups = tuple((slot, moved(index)) for slot, index in self.groups)
        return StepRows(moved(self.slots), groups, moved(self.padded), moved(self.keep), self.block)


def _span(rows: torch.Tensor) -> slice | torch.Tensor:
    first, last = int(rows[0]), int(rows[-1])
    return slice(first, last + 1) if last - first + 1 == len(rows) else rows


_ROWS: StepRows | None = None


def set_rows(rows: StepRows | None) -> None:
    global _ROWS
    _ROWS = rows


def current_rows() -> StepRows | None:
    """The running step's adapter rows (None: a step of base rows only)."""
    return _ROWS


class LoraLinear(nn.Module):
    """`base` (any linear module: packed, quantised or nn.Linear) plus, on each row of an adapter that
    targets it, that adapter's x·Aᵀ·Bᵀ (B scaled at load).

    `bounds` are the output rows [start, end) of each target (piece) the linear holds: one for a plain
    projection, q/k/v or gate/up for a fused one. The adapters' weights are stacked by slot: Aᵀ [slots, in,
    pieces · max_rank], each piece's A in its own max_rank columns, and per piece Bᵀ [slots, max_rank, its
    rows] (zeros past an adapter's rank, and for a target an adapter leaves out). A step's groups run as
    one batched shrink and one batched expand per piece over the groups padded to one length, or one such
    pair per group where padding would waste more than it holds (a long prompt beside short decodes)."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, bounds: list[tuple[int, int]]):
        super().__init__()
        self.base, self.in_features, self.out_features, self.bounds = base, in_features, out_features, bounds
        self.a_t: torch.Tensor | None = None
        self.b_t: list[torch.Tensor] = []
        # the slots whose adapter targets this linear
        self.present: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = _ROWS
        if rows is None or not self.present:
            return y
        flat_x, flat_y = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        if rows.padded is None:
            for slot, index in rows.groups:
                if slot in self.present:
                    self._add(flat_x, flat_y, index, self.a_t[slot], [b_t[slot] for b_t in self.b_t])
            return y
        a_t, b_ts = self.a_t[rows.slots], [b_t[rows.slots] for b_t in self.b_t]
        if rows.block is not None:
            shape = rows.padded.shape
            target = flat_y[rows.block].view(*shape, -1)
            self._expand(torch.bmm(flat_x[rows.block].view(*shape, -1), a_t), b_ts, target)
            return y
        delta = y.new_zeros(*rows.padded.shape, self.out_features)
        self._expand(torch.bmm(flat_x[rows.padded], a_t), b_ts, delta)
        delta, index = delta.view(-1, self.out_features), rows.padded.view(-1)
        if rows.keep is not None:
            delta, index = delta[rows.keep], index[rows.keep]
        flat_y.index_add_(0, index, delta)
        return y

    def _expand(self, shrunk: torch.Tensor, b_ts: list[torch.Tensor], target: torch.Tensor) -> None:
        """target[..., piece's rows] += shrunk[..., piece's columns] · Bᵀ of each piece, batched."""
        width = shrunk.shape[-1] // len(self.bounds)
        for piece, ((start, end), b_t) in enumerate(zip(self.bounds, b_ts, strict=True)):
            target[..., start:end].baddbmm_(shrunk[..., piece * width : (piece + 1) * width], b_t)

    def _add(self, flat_x, flat_y, index, a_t: torch.Tensor, b_ts: list[torch.Tensor]) -> None:
        """One group's rows: a slice updated in place, else their delta added at their indices."""
        shrunk = flat_x[index] @ a_t
        width = shrunk.shape[-1] // len(self.bounds)
        pieces = [shrunk[:, p * width : (p + 1) * width] for p in range(len(self.bounds))]
        if isinstance(index, slice):
            for (start, end), part, b_t in zip(self.bounds, pieces, b_ts, strict=True):
                flat_y[index, start:end].addmm_(part, b_t)
            return
        delta = flat_y.new_zeros(len(index), self.out_features)
        for (start, end), part, b_t in zip(self.bounds, pieces, b_ts, strict=True):
            delta[:, start:end] = part @ b_t
        flat_y.index_add_(0, index, delta)

    def reserve(self, slots: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """Room for `slots` adapters of rank up to max_rank, all zero, on the model's device."""
        width = len(self.bounds) * max_rank
        self.a_t = torch.zeros(slots, self.in_features, width, dtype=dtype, device=device)
        self.b_t = [
            torch.zeros(slots, max_rank, end - start, dtype=dtype, device=device)
            for start, end in self.bounds
        ]

    def add(self, slot: int, pieces: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Puts an adapter in `slot`: pieces (piece index, A [r, in], B [piece's rows, r]), one per target
        of it this linear holds."""
        width = self.a_t.shape[2] // len(self.bounds)
        self.remove(slot)
        for piece, a, b in pieces:
            rank = a.shape[0]
            self.a_t[slot, :, piece * width : piece * width + rank] = a.T
            self.b_t[piece][slot, :rank] = b.T
        self.present.add(slot)

    def remove(self, slot: int) -> None:
        self.a_t[slot].zero_()
        for b_t in self.b_t:
            b_t[slot].zero_()
        self.present.discard(slot)


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
                linear = LoraLinear(base, base.in_features, base.out_features, [(0, base.out_features)])
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
        linear = LoraLinear(base, base.in_features, base.out_features, list(targets.values()))
        setattr(layer, attr, linear)
        sites.update(
            {name: Site(linear, *bounds, piece=i) for i, (name, bounds) in enumerate(targets.items())}
        )
    return sites
