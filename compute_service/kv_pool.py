"""Mapping the KV pool a handle names (the one tensor of every layer's K/V blocks the cache service owns) on
the device compute runs on (--kv-device): through its shm segment on the cpu (common/shared_pool.py), the
exported allocation on an accelerator (common/device_pool.py). A handle for another device is refused with
FailedPrecondition naming both devices and the flags that match them."""

import torch

from common import device_pool, shared_pool
from common.device_ipc import ipc_for
from common.devices import Device
from common.errors import FailedPrecondition
from protos import common_pb2


def map_kv_pool(handle: common_pb2.PoolHandle, device: Device) -> torch.Tensor:
    """The KV pool tensor on `device`; the checks of open_pool on that device (identity, epoch, geometry). A
    segment of several tensor-parallel ranks' pools (handle.shard_ranks) gives handle.shard_rank's."""
    pool = _map(handle, device)
    if handle.shard_ranks <= 1:
        return pool
    slots = len(pool) // handle.shard_ranks
    return pool[handle.shard_rank * slots : (handle.shard_rank + 1) * slots]


def _map(handle: common_pb2.PoolHandle, device: Device) -> torch.Tensor:
    if device.type != "cpu":
        return device_pool.open_pool(handle, device, ipc_for(device))
    if handle.WhichOneof("payload") in ("cuda", "npu"):
        raise FailedPrecondition(
            f"the pool is on {handle.device}, this compute service runs on the cpu: start compute with "
            f"--kv-device {handle.device}, or the cache with --kv-device cpu (pagedserve up --kv-device sets "
            "both)"
        )
    return shared_pool.open_pool(handle)
