"""The KV pool in accelerator memory: one allocation the cache service creates and holds for the pool's
life, exported by the device's IPC (common/device_ipc.py) in a PoolHandle whose payload is `cuda` or `npu`,
and mapped zero-copy by the compute service. As for a shm segment (common/shared_pool.py), the allocation
holds the pool data, then a header page (common/segment_header.py) with the epoch, dtype, shape, KV group
layout and a secret token; compute maps only an allocation whose header matches the handle, on the device
with its UUID."""

import uuid
from collections.abc import Sequence

import torch

from common.device_ipc import DeviceIpc
from common.devices import Device
from common.errors import FailedPrecondition, InvalidArgument
from common.segment_header import HEADER_BYTES, SegmentHeader
from common.shared_pool import PoolSpec, dtype_name, spec_of
from protos import common_pb2


def create(
    spec: PoolSpec, device: Device, ipc: DeviceIpc, groups: Sequence[common_pb2.KVGroupLayout] = ()
) -> tuple[torch.Tensor, common_pb2.PoolHandle]:
    """A zeroed pool on `device` (a new epoch and token), laid out in `groups` (none: one group of every
    layer), and the handle compute maps it by. The caller holds the returned tensor for the pool's life:
    the allocation is freed once no tensor of it is left."""
    assert device.type == ipc.kind, (device, ipc.kind)
    epoch = uuid.uuid4().hex
    header = SegmentHeader.new(epoch, dtype_name(spec.dtype), spec.shape, groups)
    storage = ipc.allocate(device.index, spec.nbytes + HEADER_BYTES)
    data = _bytes_of(storage)
    data[spec.nbytes :].copy_(torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8))
    pool = _view(data, spec)
    fields = ipc.export(storage)
    payload = common_pb2.DeviceIpcHandle(
        uuid=ipc.uuid(device.index),
        ipc_handle=fields[1],
        storage_size_bytes=fields[2],
        storage_offset_bytes=fields[3],
        ref_counter_handle=fields[4],
        ref_counter_offset=fields[5],
        event_handle=fields[6] or b"",
        event_sync_required=bool(fields[7]),
        nbytes=spec.nbytes,
        token=header.token,
    )
    handle = common_pb2.PoolHandle(
        device=str(device),
        shape=spec.shape,
        dtype=header.dtype,
        strides=pool.stride(),
        epoch=epoch,
        kv_groups=groups,
    )
    getattr(handle, device.type).CopyFrom(payload)
    return pool, handle


def open_pool(handle: common_pb2.PoolHandle, device: Device, ipc: DeviceIpc) -> torch.Tensor:
    """Maps the pool a handle names on this process's `device`, only if the handle is for that kind of
    device, the device's UUID is the handle's, the geometry is self-consistent and the allocation's header
    matches the handle's epoch, dtype, shape and token. InvalidArgument or FailedPrecondition (another
    device) otherwise; a refusal maps nothing."""
    payload = _payload(handle, device)
    spec = spec_of(handle, payload.nbytes)
    mine = ipc.uuid(device.index)
    if payload.uuid != mine:
        raise FailedPrecondition(
            f"the pool is on the {device.type} device with UUID {payload.uuid}, this compute service runs on "
            f"{device} (UUID {mine}): give compute and the cache the same --kv-device (on a host whose "
            "devices differ in number: the index of the same device on each)"
        )
    if payload.storage_size_bytes < spec.nbytes + HEADER_BYTES:
        raise InvalidArgument(
            f"the exported allocation holds {payload.storage_size_bytes} bytes, less than the pool's "
            f"{spec.nbytes} and a {HEADER_BYTES}-byte header"
        )
    # NOTE: unlike a segment's file, an IPC allocation's size cannot be asked before mapping it; the handle
    # comes only from the gateway (AttachPool's one authorized caller), and its header is checked next.
    try:
        storage = ipc.open(device.index, _fields(device, payload))
    except RuntimeError as exc:
        raise FailedPrecondition(
            f"the {handle.device} pool's IPC handle cannot be opened on {device} ({exc}): its cache exited, "
            "or the handle is not the one CreatePool returned"
        ) from exc
    data = _bytes_of(storage)
    _check_header(SegmentHeader.unpack(data[spec.nbytes :].cpu().numpy().tobytes()), handle, payload)
    pool = _view(data, spec)
    if tuple(pool.stride()) != tuple(handle.strides):
        raise InvalidArgument(f"pool strides {list(handle.strides)} are not contiguous {list(pool.stride())}")
    return pool


def _payload(handle: common_pb2.PoolHandle, device: Device) -> common_pb2.DeviceIpcHandle:
    kind = handle.WhichOneof("payload")
    if kind != device.type or handle.device.partition(":")[0] != device.type:
        raise FailedPrecondition(
            f"the pool is on {handle.device or '?'} ({kind or 'no'} handle), this compute service runs on "
            f"{device}: give compute and the cache the same --kv-device (pagedserve up "
            "--kv-device sets both)"
        )
    return getattr(handle, kind)


def _fields(device: Device, payload: common_pb2.DeviceIpcHandle) -> tuple:
    return (
        device.index,
        payload.ipc_handle,
        payload.storage_size_bytes,
        payload.storage_offset_bytes,
        payload.ref_counter_handle,
        payload.ref_counter_offset,
        payload.event_handle,
        payload.event_sync_required,
    )


def _check_header(
    header: SegmentHeader | None, handle: common_pb2.PoolHandle, payload: common_pb2.DeviceIpcHandle
) -> None:
    if header is None:
        raise InvalidArgument(
            f"refusing the {handle.device} pool: it has no pagedserve header (magic missing)"
        )
    differ = header.mismatches(handle, payload.token)
    if differ:
        raise InvalidArgument(
            f"refusing the {handle.device} pool: its header does not match the handle's {', '.join(differ)}; "
            "pass the handle its CreatePool returned"
        )


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _view(data: torch.Tensor, spec: PoolSpec) -> torch.Tensor:
    return data[: spec.nbytes].view(spec.dtype).view(spec.shape)
