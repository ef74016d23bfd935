"""KV groups: a model's layers split into groups of equal size that keep separate block tables over one pool.

Layers of one attention pattern (full attention, or one sliding window) share tables; a pattern's layers
are cut into groups of `group_size` layers, the greatest common divisor of the patterns' layer counts, so
every group fills the same slots of a block and no slot is padding. A block id then holds K/V for
group_size layers: layer `layers[j]` of a group reads and writes slot j of the pool's first axis
([group_size, 2, num_blocks, block_size, Hkv, D]) through that group's table. A model without windows is
one group of all its layers: the single-table layout.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

from common.errors import InvalidArgument
from common.paging import blocks_for


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers (in pool slot order) that share block tables; window 0: full attention, else a query at p
    sees keys (p - window, p]."""

    layers: tuple[int, ...]
    window: int = 0

    def first_kept(self, num_computed: int, block_size: int) -> int:
        """The first table index a step writing from token num_computed on still reads: every block before
        it lies wholly before the window of its first query (0 for full attention)."""
        if not self.window:
            return 0
        return max(0, num_computed - self.window + 1) // block_size


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a table of a group sliding `window` tokens holds at once: those the window spans, and
    the one it straddles (KVGroup.first_kept releases every block before them)."""
    assert window > 0, window
    return blocks_for(window, block_size) + 1


def group_layers(windows: Sequence[int]) -> tuple[KVGroup, ...]:
    """Groups for layers whose windows are `windows` (0: full): full-attention groups first, then each
    window's, each in layer order. InvalidArgument for no layers or a negative window."""
    if not windows:
        raise InvalidArgument("a model needs at least one layer to group")
    if min(windows) < 0:
        raise InvalidArgument(f"sliding windows must be >= 0 (0: full attention), got {list(windows)}")
    patterns: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        patterns.setdefault(window, []).append(layer)
    size = gcd(*(len(layers) for layers in patterns.values()))
    return tuple(
        KVGroup(tuple(layers[start : start + size]), window)
        for window, layers in sorted(patterns.items())
        for start in range(0, len(layers), size)
    )


def group_size(groups: Sequence[KVGroup]) -> int:
    """Layers per group: the pool's first axis."""
    return len(groups[0].layers)
