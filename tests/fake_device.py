"""A fake accelerator IPC (common/device_ipc.py DeviceIpc) over CPU memory, for testing the cuda/npu pool
handles' code paths where no such device exists: `open` returns the very storage `allocate` made, so a
write through one mapping is seen through the other, as with real IPC."""

import itertools

import torch

from common.errors import FailedPrecondition


class FakeIpc:
    def __init__(self, kind: str = "cuda", uuids: tuple[str, ...] = ("GPU-fake-0", "GPU-fake-1")) -> None:
        self.kind = kind
        self.uuids = uuids
        self.free = 2**30
        self.exported: dict[bytes, torch.UntypedStorage] = {}
        self._ids = itertools.count()

    def require(self, index: int) -> None:
        if index >= len(self.uuids):
            raise FailedPrecondition(f"{self.kind}:{index}: no such fake device")

    def uuid(self, index: int) -> str:
        return self.uuids[index]

    def free_bytes(self, index: int) -> int:
        return self.free

    def allocate(self, index: int, nbytes: int) -> torch.UntypedStorage:
        return torch.zeros(nbytes, dtype=torch.uint8).untyped_storage()

    def export(self, storage: torch.UntypedStorage) -> tuple:
        handle = f"ipc-{next(self._ids)}".encode()
        self.exported[handle] = storage
        return (0, handle, storage.nbytes(), 0, b"refcounter", 0, None, False)

    def open(self, index: int, fields: tuple) -> torch.UntypedStorage:
        if fields[1] not in self.exported:
            raise RuntimeError("invalid IPC handle")
        return self.exported[fields[1]]
