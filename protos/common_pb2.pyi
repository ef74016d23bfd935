from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolHandle(_message.Message):
    __slots__ = ("device", "shape", "dtype", "strides", "epoch", "shm", "cuda", "npu", "kv_scales_id", "fence", "kv_groups", "shard_ranks", "shard_rank", "image_store")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    NPU_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANKS_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANK_FIELD_NUMBER: _ClassVar[int]
    IMAGE_STORE_FIELD_NUMBER: _ClassVar[int]
    device: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    strides: _containers.RepeatedScalarFieldContainer[int]
    epoch: str
    shm: SharedMemoryHandle
    cuda: DeviceIpcHandle
    npu: DeviceIpcHandle
    kv_scales_id: str
    fence: SharedMemoryHandle
    kv_groups: _containers.RepeatedCompositeFieldContainer[KVGroupLayout]
    shard_ranks: int
    shard_rank: int
    image_store: SharedMemoryHandle
    def __init__(self, device: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., strides: _Optional[_Iterable[int]] = ..., epoch: _Optional[str] = ..., shm: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., cuda: _Optional[_Union[DeviceIpcHandle, _Mapping]] = ..., npu: _Optional[_Union[DeviceIpcHandle, _Mapping]] = ..., kv_scales_id: _Optional[str] = ..., fence: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., kv_groups: _Optional[_Iterable[_Union[KVGroupLayout, _Mapping]]] = ..., shard_ranks: _Optional[int] = ..., shard_rank: _Optional[int] = ..., image_store: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ...) -> None: ...

class KVGroupLayout(_message.Message):
    __slots__ = ("layers", "window")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    window: int
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., window: _Optional[int] = ...) -> None: ...

class SharedMemoryHandle(_message.Message):
    __slots__ = ("path", "nbytes", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    nbytes: int
    token: bytes
    def __init__(self, path: _Optional[str] = ..., nbytes: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class DeviceIpcHandle(_message.Message):
    __slots__ = ("uuid", "ipc_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "nbytes", "token")
    UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    ipc_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    nbytes: int
    token: bytes
    def __init__(self, uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., nbytes: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("id", "name", "path", "rank", "target_modules")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...
