"""Creating the pool on the cache service's device (--kv-device): a shm segment on the cpu
(common/shared_pool.py), one exported allocation on an accelerator (common/device_pool.py), refused with
ResourceExhausted before anything is allocated unless the device has the room."""

from collections.abc import Sequence

import torch

from cache_service import host_memory
from common import device_pool, shared_pool
from common.device_ipc import ipc_for
from common.devices import Device
from common.errors import FailedPrecondition, ResourceExhausted
from common.segment_header import HEADER_BYTES
from common.shared_pool import PoolSpec
from protos import common_pb2


def create(
    spec: PoolSpec, device: Device, groups: Sequence[common_pb2.KVGroupLayout] = ()
) -> tuple[torch.Tensor, common_pb2.PoolHandle]:
    """The pool tensor (which the caller holds for the pool's life) and its handle, laid out in `groups`."""
    if device.type == "cpu":
        return shared_pool.create(spec, groups=groups)
    ipc = ipc_for(device)
    free = ipc.free_bytes(device.index)
    if spec.nbytes + HEADER_BYTES > free:
        raise ResourceExhausted(
            f"a pool of {spec.nbytes} bytes ({spec.nbytes / 2**30:.2f} GiB) does not fit {device}: "
            f"{free} bytes ({free / 2**30:.2f} GiB) are free there; give a smaller --kv-memory/--kv-blocks"
        )
    return device_pool.create(spec, device, ipc, groups)


def refusal(device: Device, kv_memory: int, kv_tier: str = "none") -> str | None:
    """Why the cache service cannot start with this --kv-device, --kv-memory and --kv-tier (None if it
    can): the host must back a cpu pool's bytes; an accelerator must exist and share memory (its room is
    checked when the pool is created, once its size is known) and have no KV tier."""
    if device.type != "cpu" and kv_tier != "none":
        # NOTE: a tier copies blocks through a numpy view of the pool, which host memory only has.
        return f"--kv-tier {kv_tier} reads the pool through host memory: it needs --kv-device cpu"
    try:
        if device.type == "cpu":
            host_memory.require_room_here(kv_memory, 0)
        else:
            ipc_for(device)
    except ResourceExhausted as err:
        return f"--kv-memory: {err}"
    except FailedPrecondition as err:
        return f"--kv-device {device}: {err}"
    return None
