"""Per-block key summaries for block-sparse decode (compute_service.attention.sparse): for every block of the
attached pool and every layer that attends sparsely, the element-wise minimum and maximum of its keys per KV
head, in float32, beside the pool in compute.

They are derived data, rebuilt from the pool's keys whenever they may be stale, so a prefix-cache hit, a
copy-on-write, a restored tier block or a restart of either service never leaves one wrong: a block's
summary is current only from the time it is rebuilt from the keys of a full block until compute writes into
that block, or a step says the sequence's cached prefix was found in the cache rather than written by this
compute for it (ForwardRequest.cached_prefix: the cache may have filled a reused block by copy or restore),
or the pool is attached again (a new summary set, none current). Only full blocks outside a decode's recent
window are ever read, and those are rebuilt, when not current, by the step that reads them, for every sparse
layer at once, before any layer attends.
"""

import torch


class BlockSummaries:
    """The summaries of one attached pool's blocks, for the layers `layers` (indices)."""

    def __init__(self, k_caches: list[torch.Tensor], layers: tuple[int, ...]) -> None:
        num_blocks, self.block_size, kv_heads, head_dim = k_caches[0].shape
        self.k_caches = k_caches
        self.slot = {layer: i for i, layer in enumerate(layers)}
        # [sparse layers, blocks, (min, max), Hkv, D]
        self.bounds = torch.zeros(len(layers), num_blocks, 2, kv_heads, head_dim)
        self.current = torch.zeros(num_blocks, dtype=torch.bool)

    def written(self, slots: torch.Tensor) -> None:
        """The step writes K/V at `slots`: their blocks' summaries are no longer current."""
        self.current[slots // self.block_size] = False

    def forget(self, blocks: torch.Tensor) -> None:
        """The pool's content of `blocks` may have changed outside compute's writes."""
        self.current[blocks] = False

    def refresh(self, blocks: torch.Tensor) -> None:
        """Rebuilds, from the pool's keys, the summaries of those of `blocks` (full blocks) not current."""
        stale = blocks[~self.current[blocks]].unique()
        if not len(stale):
            return
        for layer, i in self.slot.items():
            keys = self.k_caches[layer][stale].float()
            self.bounds[i, stale, 0] = keys.amin(1)
            self.bounds[i, stale, 1] = keys.amax(1)
        self.current[stale] = True

    def of(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key minima and maxima of `blocks` (any shape S) in layer `layer`: two [*S, Hkv, D] tensors."""
        bounds = self.bounds[self.slot[layer]][blocks]
        return bounds[..., 0, :, :], bounds[..., 1, :, :]

    def of_layer(self, layer: int) -> torch.Tensor:
        """Every block's summary in layer `layer`, as the native kernel reads it: [blocks, 2, Hkv, D]."""
        return self.bounds[self.slot[layer]]

    def has(self, layer: int) -> bool:
        """Whether layer `layer` attends sparsely (has summaries)."""
        return layer in self.slot
