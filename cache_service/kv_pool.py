"""The KV pool the service owns: the [layer slots, K/V, blocks, block_size, heads, head_dim] tensor in a
segment (common/shared_pool.py), its spec and KV groups from a CreatePool request, and the block manager over
its blocks (one per group: cache_service/hybrid_blocks.py). A pool of several groups has group_size layer
slots, each block id holding K/V for the layers of whichever group's table holds it."""

from dataclasses import dataclass, replace

import torch

from cache_service import device_room, host_memory
from cache_service.allocators import registry
from cache_service.block_manager import BlockManager
from cache_service.hybrid_blocks import HybridBlocks
from common import shared_pool
from common.devices import CPU, Device
from common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from common.kv_groups import KVGroup, group_layers, group_size
from common.session_fence import SessionFence
from common.shared_pool import PoolSpec
from protos import cache_pb2, common_pb2

MAX_BLOCK_SIZE = 1024
MAX_BLOCKS = 2**31 - 1  # block ids travel as int32
MAX_POOL_BYTES = 2**63 - 1  # a handle's sizes travel as int64
# Far above any model's layers; bounds the groups a CreatePool lists before its sizes are checked.
MAX_LAYERS = 4096


def spec_from_request(
    request: cache_pb2.CreatePoolRequest, default_blocks: int, default_memory: int, slots: int = 0
) -> PoolSpec:
    """The pool a CreatePool asks for, of `slots` layer slots (0: every layer's; a pool of KV groups has
    group_size); its budget is the request's if set, else the service's defaults.

    Raises InvalidArgument for a bad geometry, block size, dtype (or an fp8 one without its scales'
    identity, another with one) or budget (also one beyond int32 block ids or int64 bytes), and
    ResourceExhausted when the budget holds no block; blocks are sized by the dtype's itemsize (fp8: a
    quarter of float32's bytes). Whether the host can back the pool is cache_service/host_memory.py's check.
    """
    geometry = request.geometry
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        if getattr(geometry, name) <= 0:
            raise InvalidArgument(f"geometry.{name} must be > 0, got {getattr(geometry, name)}")
    if not 0 < request.block_size <= MAX_BLOCK_SIZE:
        raise InvalidArgument(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {request.block_size}")
    dtype = shared_pool.dtype_from_name(request.kv_dtype)
    _check_scales(dtype, request.kv_scales_id)
    if request.num_blocks < 0 or request.memory_bytes < 0:
        raise InvalidArgument(
            f"budget must be >= 0, got num_blocks={request.num_blocks} memory_bytes={request.memory_bytes}"
        )
    if request.num_blocks and request.memory_bytes:
        raise InvalidArgument("set num_blocks or memory_bytes, not both")
    slots = slots or geometry.num_layers
    one_block = PoolSpec(slots, 1, request.block_size, geometry.num_kv_heads, geometry.head_dim, dtype)
    if request.num_blocks or request.memory_bytes:
        blocks, memory, source = request.num_blocks, request.memory_bytes, "memory_bytes"
    else:
        blocks, memory, source = default_blocks, default_memory, "the service's --kv-memory"
    num_blocks = blocks or memory // one_block.block_bytes
    if num_blocks < 1:
        raise ResourceExhausted(
            f"{source} of {memory} bytes holds no block: one block takes {one_block.block_bytes} bytes "
            f"({slots} layers x K,V x {request.block_size} tokens x "
            f"{geometry.num_kv_heads} heads x {geometry.head_dim} x {dtype.itemsize} bytes); "
            "give more memory or a smaller block_size"
        )
    if num_blocks > MAX_BLOCKS:
        raise InvalidArgument(f"{num_blocks} blocks is more than block ids can address ({MAX_BLOCKS})")
    spec = replace(one_block, num_blocks=num_blocks)
    if spec.nbytes > MAX_POOL_BYTES:
        raise InvalidArgument(
            f"a pool of {spec.nbytes} bytes is more than a handle can address ({MAX_POOL_BYTES})"
        )
    return spec


def pool_groups(request: cache_pb2.CreatePoolRequest) -> tuple[KVGroup, ...]:
    """The pool's KV groups (common/kv_groups.py) by the layers' sliding windows: one group of every layer
    without windows. InvalidArgument unless sliding_windows is empty or one window >= 0 per layer, and
    for more than MAX_LAYERS layers."""
    windows, num_layers = list(request.sliding_windows), request.geometry.num_layers
    if num_layers > MAX_LAYERS:
        raise InvalidArgument(f"geometry.num_layers must be at most {MAX_LAYERS}, got {num_layers}")
    if windows and len(windows) != num_layers:
        raise InvalidArgument(
            f"sliding_windows has {len(windows)} entries for {num_layers} layers: send one per layer, or none"
        )
    return group_layers(windows) if windows else (KVGroup(tuple(range(num_layers))),)


def shard_ranks(request: cache_pb2.CreatePoolRequest) -> int:
    """The tensor-parallel ranks whose pools the segment holds (0 is read as 1). InvalidArgument below 0."""
    if request.shard_ranks < 0:
        raise InvalidArgument(f"shard_ranks must be >= 0, got {request.shard_ranks}")
    return request.shard_ranks or 1


def group_layouts(groups: tuple[KVGroup, ...]) -> list[common_pb2.KVGroupLayout]:
    """The groups as a PoolHandle carries them."""
    return [common_pb2.KVGroupLayout(layers=group.layers, window=group.window) for group in groups]


def _check_scales(dtype: torch.dtype, kv_scales_id: str) -> None:
    if shared_pool.is_fp8(dtype) and not kv_scales_id:
        raise InvalidArgument(
            f"an {shared_pool.dtype_name(dtype)} pool needs kv_scales_id, the identity of the scales its K/V "
            "are stored with: pass the one GetModelInfo reports"
        )
    if not shared_pool.is_fp8(dtype) and kv_scales_id:
        raise InvalidArgument(
            f"kv_scales_id is for fp8 pools only; a {shared_pool.dtype_name(dtype)} pool stores unscaled K/V"
        )
    if len(kv_scales_id) > 64 or not kv_scales_id.isascii():
        raise InvalidArgument("kv_scales_id must be at most 64 ASCII characters")


@dataclass(frozen=True)
class KVPool:
    """A created pool: the owner's mapping of the segment, the handle others map it by, its blocks and its
    session fence (common/session_fence.py)."""

    spec: PoolSpec
    model: str
    tensor: torch.Tensor
    handle: common_pb2.PoolHandle
    blocks: BlockManager | HybridBlocks
    fence: SessionFence
    kv_scales_id: str = ""
    groups: tuple[KVGroup, ...] = ()

    @classmethod
    def create(
        cls,
        spec: PoolSpec,
        model: str,
        allocator: str,
        prefix_caching: bool,
        kv_scales_id: str = "",
        device: Device = CPU,
        groups: tuple[KVGroup, ...] = (),
        ranks: int = 1,
    ) -> "KVPool":
        """A new zeroed pool with a new epoch on `device` (a shm segment on the cpu; see
        cache_service/device_room.py otherwise); the caller must `release` it. ResourceExhausted, before
        anything is allocated (the allocator's state too), unless the host or device can back it. `groups`
        (`pool_groups`, of spec.num_layers layers each; none: one full group): the tables each sequence
        holds, and the windows they keep; `ranks`: the tensor-parallel ranks' pools the segment holds,
        rank-major in the layer slots (spec.num_layers is ranks x group_size), one block table for all."""
        groups = groups or (KVGroup(tuple(range(spec.num_layers // ranks))),)
        assert group_size(groups) * ranks == spec.num_layers, (groups, spec, ranks)
        host_memory.require_room_here(*_host_share(spec, device))
        allocator_ = registry.create(allocator, spec.num_blocks)
        tensor, handle = device_room.create(spec, device, group_layouts(groups))
        handle.kv_scales_id = kv_scales_id
        handle.shard_ranks = ranks if ranks > 1 else 0
        try:
            fence = SessionFence.create(handle)
        except BaseException:
            shared_pool.release(handle)
            raise

        def copy_block(src: int, dst: int) -> None:
            tensor[:, :, dst].copy_(tensor[:, :, src])

        identity = kv_identity(model, spec.dtype, kv_scales_id)
        if len(groups) > 1:
            blocks = HybridBlocks(allocator_, groups, spec.block_size, copy_block, prefix_caching, identity)
        else:
            group = groups[0] if groups[0].window else None
            blocks = BlockManager(allocator_, spec.block_size, copy_block, prefix_caching, identity, group)
        return cls(spec, model, tensor, handle, blocks, fence, kv_scales_id, groups)

    @property
    def identity(self) -> str:
        """The root of its prefix hashes beyond the salt (`kv_identity`): what a tier must hash with too."""
        return kv_identity(self.model, self.spec.dtype, self.kv_scales_id)

    def grouped(self, per_group: list) -> list:
        """What the block manager returned per sequence (reserve's tails, fork's tables), per KV group."""
        return per_group if isinstance(self.blocks, HybridBlocks) else [per_group]

    def held_blocks(self) -> list[int]:
        """Per KV group, the blocks its tables hold, summed over sequences."""
        if isinstance(self.blocks, HybridBlocks):
            return self.blocks.held_blocks()
        return [self.blocks.stats().table_slots // self.spec.block_size]

    @property
    def window(self) -> int:
        """The window the tables keep when every layer slides it (one sliding group), else 0."""
        return self.groups[0].window if len(self.groups) == 1 else 0

    def require_layout(
        self, spec: PoolSpec, model: str, kv_scales_id: str = "", groups: tuple[KVGroup, ...] = ()
    ) -> None:
        """FailedPrecondition unless `spec` differs from this pool's at most in its number of blocks, for the
        same model, scales and KV groups: a live pool's layout never changes (callers hold its handle and
        block ids)."""
        groups = groups or (KVGroup(tuple(range(spec.num_layers))),)
        mine = (self.spec, self.model, self.kv_scales_id, self.groups)
        if (replace(spec, num_blocks=self.spec.num_blocks), model, kv_scales_id, groups) == mine:
            return
        raise FailedPrecondition(
            f"the cache service holds a pool of another layout ({_layout(*mine)}) than asked "
            f"({_layout(spec, model, kv_scales_id, groups)}): a pool keeps its layout while the cache "
            "service runs; restart the cache service to change the layout"
        )

    def require_size(self, spec: PoolSpec) -> None:
        """FailedPrecondition, naming both sizes, unless `spec` (a CreatePool's explicit budget) has this
        pool's number of blocks: a live pool is never resized, and a caller must not believe it was."""
        if spec.num_blocks == self.spec.num_blocks:
            return
        raise FailedPrecondition(
            f"the cache service holds a pool of {_size(self.spec)}, asked for {_size(spec)}: a pool keeps "
            "its size while the cache service runs; send no num_blocks or memory_bytes to use the live "
            "pool, or restart the cache service to resize it"
        )

    def read_block(self, layer: int, block_id: int) -> torch.Tensor:
        """K then V of one block in one layer slot (a pool of several KV groups has group_size of them),
        [2, block_size, num_kv_heads, head_dim], a view of the pool."""
        if not 0 <= layer < self.spec.num_layers:
            slots = (
                f"{self.spec.num_layers} layer slots"
                if len(self.groups) > 1
                else f"{self.spec.num_layers} layers"
            )
            raise InvalidArgument(f"layer {layer} does not exist: the pool has {slots}")
        if not 0 <= block_id < self.spec.num_blocks:
            raise InvalidArgument(
                f"block {block_id} does not exist: the pool has {self.spec.num_blocks} blocks"
            )
        return self.tensor[layer, :, block_id]

    def release(self) -> None:
        """Unlinks the segment and the fence (an accelerator pool is freed with this object); mappings and
        descriptors others hold stay valid until they drop them."""
        shared_pool.release(self.handle)
        self.fence.close()


def _host_share(spec: PoolSpec, device: Device) -> tuple[int, int]:
    """(pool bytes, blocks) the host must back: an accelerator pool takes only its bookkeeping there."""
    return (spec.nbytes, spec.num_blocks) if device == CPU else (0, spec.num_blocks)


def kv_identity(model: str, dtype: torch.dtype, kv_scales_id: str) -> str:
    """What a prefix hash's root covers beyond the request's salt: the model and the exact encoding of its
    K/V (dtype, fp8 scales), so that blocks are shared (or kept by a tier) only between equal encodings."""
    return f"{model}\0{shared_pool.dtype_name(dtype)}\0{kv_scales_id}"


def _size(spec: PoolSpec) -> str:
    return f"{spec.num_blocks} blocks ({spec.nbytes / 2**20:.1f} MiB)"


def _layout(spec: PoolSpec, model: str, kv_scales_id: str, groups: tuple[KVGroup, ...]) -> str:
    scales = f", kv scales {kv_scales_id}" if kv_scales_id else ""
    windows = ", ".join(f"a {group.window}-token window" for group in groups if group.window)
    window = f", tables keep {windows}" if windows else ""
    slots = (
        f"{spec.num_layers} layer slots, {len(groups)} KV groups"
        if len(groups) > 1
        else f"{spec.num_layers} layers"
    )
    return (
        f"{slots}, {spec.num_kv_heads} kv heads, head_dim {spec.head_dim}, "
        f"block_size {spec.block_size}, {shared_pool.dtype_name(spec.dtype)}{scales}{window}, model {model!r}"
    )
