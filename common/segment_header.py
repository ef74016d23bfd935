"""The segment's header: one page the cache writes after the pool data, so a mapper can tell a segment the
cache created from any other file. It holds a magic, the pool's epoch, dtype and shape, a digest of its KV
group layout (PoolHandle.kv_groups: which layers each pool slot holds, and each group's window), and a
random secret token that only the PoolHandle from CreatePool carries (never GetStats, never a log line)."""

import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from protos import common_pb2

MAGIC = b"pagedserve-kv\x00v2"
# NOTE: a whole page after the pool data, so the pool's mapping (from offset 0) never covers it.
HEADER_BYTES = 4096
TOKEN_BYTES = 32
# magic, epoch (uuid4 hex), dtype name, shape [group_size, 2, blocks, block_size, kv_heads, head_dim],
# groups (groups_digest), token
_LAYOUT = struct.Struct(f"<{len(MAGIC)}s32s16s6q32s{TOKEN_BYTES}s")
assert _LAYOUT.size <= HEADER_BYTES


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def groups_digest(groups: Iterable[common_pb2.KVGroupLayout]) -> bytes:
    """32 bytes naming a KV group layout: each group's layers in slot order and its window, in order (none:
    the one group of every layer a handle without kv_groups means)."""
    digest = hashlib.sha256()
    for group in groups:
        digest.update(struct.pack(f"<2i{len(group.layers)}i", len(group.layers), group.window, *group.layers))
    return digest.digest()


@dataclass(frozen=True)
class SegmentHeader:
    epoch: str
    dtype: str
    shape: tuple[int, ...]
    groups: bytes
    token: bytes

    @classmethod
    def new(
        cls, epoch: str, dtype: str, shape: tuple[int, ...], groups: Iterable[common_pb2.KVGroupLayout]
    ) -> "SegmentHeader":
        """A new pool's header, with a new secret token."""
        return cls(epoch, dtype, tuple(shape), groups_digest(groups), new_token())

    @classmethod
    def of(cls, handle: common_pb2.PoolHandle, token: bytes) -> "SegmentHeader":
        """The header a file of this handle's pool holds, with `token`."""
        return cls(handle.epoch, handle.dtype, tuple(handle.shape), groups_digest(handle.kv_groups), token)

    def pack(self) -> bytes:
        """HEADER_BYTES bytes; raises ValueError for a field that does not fit its slot."""
        assert len(self.shape) == 6 and len(self.groups) == 32 and len(self.token) == TOKEN_BYTES, self
        epoch, dtype = self.epoch.encode("ascii"), self.dtype.encode("ascii")
        if len(epoch) > 32 or len(dtype) > 16:
            raise ValueError(f"epoch {self.epoch!r} or dtype {self.dtype!r} too long for the header")
        packed = _LAYOUT.pack(MAGIC, epoch, dtype, *self.shape, self.groups, self.token)
        return packed.ljust(HEADER_BYTES, b"\x00")

    @classmethod
    def unpack(cls, data: bytes) -> "SegmentHeader | None":
        """The header data starts with; None if it does not start with one."""
        if len(data) < _LAYOUT.size or not data.startswith(MAGIC):
            return None
        _, epoch, dtype, *shape, groups, token = _LAYOUT.unpack_from(data)
        return cls(_text(epoch), _text(dtype), tuple(shape), groups, token)

    def mismatches(self, handle: common_pb2.PoolHandle, token: bytes) -> list[str]:
        """The names of the fields that differ from the handle's, and `token` (compared in constant time)."""
        theirs = SegmentHeader.of(handle, token)
        differ = [
            name
            for name, mine, other in (
                ("epoch", self.epoch, theirs.epoch),
                ("dtype", self.dtype, theirs.dtype),
                ("shape", self.shape, theirs.shape),
                ("kv_groups", self.groups, theirs.groups),
            )
            if mine != other
        ]
        if not hmac.compare_digest(self.token, token):
            differ.append("token")
        return differ


def _text(field: bytes) -> str:
    return field.rstrip(b"\x00").decode("ascii", errors="replace")


def write(fd: int, offset: int, header: SegmentHeader) -> None:
    """Writes the header at offset (the end of the pool data) of the open segment fd."""
    data = header.pack()
    written = os.pwrite(fd, data, offset)
    assert written == len(data), f"short header write: {written} of {len(data)} bytes"


def read(fd: int, offset: int) -> SegmentHeader | None:
    """The header at offset of the open segment fd; None if there is none."""
    return SegmentHeader.unpack(os.pread(fd, HEADER_BYTES, offset))
