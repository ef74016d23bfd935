"""An attached pool's KV groups as compute reads them (PoolHandle.kv_groups, common/kv_groups.py): the pool
slot and the group's tables each layer uses, checked against the model's layers before the pool is used."""

from dataclasses import dataclass

from common.errors import InvalidArgument
from protos import common_pb2


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Per layer of the model, its slot in the pool's first axis and its KV group (the step's tables)."""

    slots: tuple[int, ...]
    groups: tuple[int, ...]
    num_groups: int
    group_size: int


def pool_layout(handle: common_pb2.PoolHandle, windows: tuple[int, ...]) -> PoolLayout:
    """The layout of the pool `handle` names for a model whose layers slide `windows` (0: full attention);
    a handle without kv_groups is one group of every layer. InvalidArgument, in one line naming what differs,
    unless the groups hold every layer once, in groups of shape[0] layers, each keeping its layers' window
    (a group of window 0 keeps every block, which serves any layer). The caller checks the rest of the
    shape."""
    layouts = [(tuple(g.layers), g.window) for g in handle.kv_groups] or [(tuple(range(len(windows))), 0)]
    size = len(layouts[0][0])
    held = sorted(layer for layers, _ in layouts for layer in layers)
    problem = ""
    if held != list(range(len(windows))):
        problem = f"its groups hold layers {held}, the model has {len(windows)} layers, each in one group"
    elif any(len(layers) != size for layers, _ in layouts) or (
        handle.kv_groups and list(handle.shape[:1]) != [size * (handle.shard_ranks or 1)]
    ):
        sizes = [len(layers) for layers, _ in layouts]
        problem = f"groups of {sizes} layers for {list(handle.shape[:1])} layer slots"
    else:
        wrong = [
            (layer, window)
            for layers, window in layouts
            for layer in layers
            if window not in (0, windows[layer])
        ]
        if wrong:
            layer, window = wrong[0]
            problem = f"layer {layer}'s group keeps a {window}-token window, the layer's is {windows[layer]}"
    if problem:
        raise InvalidArgument(
            f"the pool's KV groups do not match the model: {problem}; create the pool with the "
            "sliding_windows GetModelInfo reports"
        )
    slot, group = [0] * len(windows), [0] * len(windows)
    for index, (layers, _) in enumerate(layouts):
        for position, layer in enumerate(layers):
            slot[layer], group[layer] = position, index
    return PoolLayout(tuple(slot), tuple(group), len(layouts), size)
