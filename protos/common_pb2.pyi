from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolHandle(_message.Message):
    __slots__ = ("device", "shape", "dtype", "strides", "epoch", "shm", "kv_scales_id")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_ID_FIELD_NUMBER: _ClassVar[int]
    device: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    strides: _containers.RepeatedScalarFieldContainer[int]
    epoch: str
    shm: SharedMemoryHandle
    kv_scales_id: str
    def __init__(self, device: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., strides: _Optional[_Iterable[int]] = ..., epoch: _Optional[str] = ..., shm: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., kv_scales_id: _Optional[str] = ...) -> None: ...

class SharedMemoryHandle(_message.Message):
    __slots__ = ("path", "nbytes", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    nbytes: int
    token: bytes
    def __init__(self, path: _Optional[str] = ..., nbytes: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...
