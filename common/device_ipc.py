"""Each accelerator's IPC: allocating the KV pool on it, exporting the allocation to another process and
mapping it there (the devices are common/devices.py's).

The accelerator modules are imported only when their device is selected: torch_npu is an optional extra
(`pip install -e '.[npu]'`), and a CPU-only torch never touches CUDA."""

import importlib
from typing import Protocol

import torch

from common.devices import Device
from common.errors import FailedPrecondition


class DeviceIpc(Protocol):
    """One accelerator's memory shared between processes; `export` and `open` carry the 8 fields of
    UntypedStorage._share_cuda_() (device, handle, size, offset, ref counter handle and offset, event
    handle, event sync required)."""

    kind: str

    def require(self, index: int) -> None:
        """FailedPrecondition naming what is missing unless device `index` exists and can share memory."""

    def uuid(self, index: int) -> str: ...

    def free_bytes(self, index: int) -> int: ...

    def allocate(self, index: int, nbytes: int) -> torch.UntypedStorage:
        """A zeroed allocation on device `index` (IPC exports the segment it lies in, with its offset)."""

    def export(self, storage: torch.UntypedStorage) -> tuple: ...

    def open(self, index: int, fields: tuple) -> torch.UntypedStorage: ...


class CudaIpc:
    kind = "cuda"

    def require(self, index: int) -> None:
        if not torch.cuda.is_available():
            raise FailedPrecondition(
                f"cuda:{index}: no CUDA device is visible (torch.cuda.is_available() is false: a CPU-only "
                "torch, no driver, or CUDA_VISIBLE_DEVICES hides them); use --kv-device cpu"
            )
        if index >= torch.cuda.device_count():
            raise FailedPrecondition(
                f"cuda:{index}: only {torch.cuda.device_count()} CUDA devices are visible"
            )

    def uuid(self, index: int) -> str:
        return str(torch.cuda.get_device_properties(index).uuid)

    def free_bytes(self, index: int) -> int:
        return torch.cuda.mem_get_info(index)[0]

    def allocate(self, index: int, nbytes: int) -> torch.UntypedStorage:
        # NOTE: CUDA IPC exports whole cudaMalloc blocks; an expandable segment cannot be exported, so the
        # pool's allocation must come from a plain segment.
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        return torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{index}").untyped_storage()

    def export(self, storage: torch.UntypedStorage) -> tuple:
        return storage._share_cuda_()

    def open(self, index: int, fields: tuple) -> torch.UntypedStorage:
        with torch.cuda.device(index):
            return torch.UntypedStorage._new_shared_cuda(index, *fields[1:])


class NpuIpc:
    """Ascend NPU memory shared with torch_npu's IPC (torch_npu 7.2 or later); ND format only."""

    kind = "npu"

    def require(self, index: int) -> None:
        npu = _torch_npu().npu
        if not npu.is_available() or index >= npu.device_count():
            raise FailedPrecondition(f"npu:{index}: no such Ascend NPU is visible (torch_npu.npu)")

    def uuid(self, index: int) -> str:
        props = _torch_npu().npu.get_device_properties(index)
        # NOTE: older torch_npu properties carry no uuid; the name and index then identify the device.
        return str(getattr(props, "uuid", "") or f"{props.name}#{index}")

    def free_bytes(self, index: int) -> int:
        return _torch_npu().npu.mem_get_info(index)[0]

    def allocate(self, index: int, nbytes: int) -> torch.UntypedStorage:
        npu = _torch_npu()
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=f"npu:{index}")
        # NOTE: ACL_FORMAT_ND is 2; a private format (NZ) would lay bytes out in tiles another process
        # cannot read as the pool's shape.
        assert npu.get_npu_format(tensor) == 2, "the pool must be in ND format"
        return tensor.untyped_storage()

    def export(self, storage: torch.UntypedStorage) -> tuple:
        _torch_npu()
        return storage._share_npu_()

    def open(self, index: int, fields: tuple) -> torch.UntypedStorage:
        _torch_npu()
        return torch.UntypedStorage._new_shared_npu(index, *fields[1:])


def _torch_npu():
    """torch_npu, imported before any IPC helper; FailedPrecondition if it is missing or too old."""
    try:
        module = importlib.import_module("torch_npu")
    except ImportError as exc:
        raise FailedPrecondition(
            f"the npu device needs torch_npu ({exc}): pip install -e '.[npu]' on a host with Ascend CANN"
        ) from exc
    if not hasattr(torch.UntypedStorage, "_share_npu_"):
        raise FailedPrecondition(
            f"torch_npu {getattr(module, '__version__', '?')} cannot share NPU memory between processes "
            "(no UntypedStorage._share_npu_): install torch_npu 7.2 or later"
        )
    return module


IPC: dict[str, type] = {"cuda": CudaIpc, "npu": NpuIpc}


def ipc_for(device: Device) -> DeviceIpc:
    """The IPC of an accelerator device, checked to be usable (FailedPrecondition otherwise)."""
    assert device.type in IPC, f"{device} is not an accelerator"
    ipc = IPC[device.type]()
    ipc.require(device.index)
    return ipc
