"""The segment's header: one page the cache writes after the pool data, so a mapper can tell a segment the
cache created from any other file. It holds a magic, the pool's epoch, dtype and shape, and a random secret
token that only the PoolHandle from CreatePool carries (never GetStats, never a log line)."""

import hmac
import os
import secrets
import struct
from dataclasses import dataclass

MAGIC = b"pagedserve-kv\x00v1"
# NOTE: a whole page after the pool data, so the pool's mapping (from offset 0) never covers it.
HEADER_BYTES = 4096
TOKEN_BYTES = 32
# magic, epoch (uuid4 hex), dtype name, shape [layers, 2, blocks, block_size, kv_heads, head_dim], token
_LAYOUT = struct.Struct(f"<{len(MAGIC)}s32s16s6q{TOKEN_BYTES}s")
assert _LAYOUT.size <= HEADER_BYTES


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


@dataclass(frozen=True)
class SegmentHeader:
    epoch: str
    dtype: str
    shape: tuple[int, ...]
    token: bytes

    def pack(self) -> bytes:
        """HEADER_BYTES bytes; raises ValueError for a field that does not fit its slot."""
        assert len(self.shape) == 6 and len(self.token) == TOKEN_BYTES, (self.shape, len(self.token))
        epoch, dtype = self.epoch.encode("ascii"), self.dtype.encode("ascii")
        if len(epoch) > 32 or len(dtype) > 16:
            raise ValueError(f"epoch {self.epoch!r} or dtype {self.dtype!r} too long for the header")
        packed = _LAYOUT.pack(MAGIC, epoch, dtype, *self.shape, self.token)
        return packed.ljust(HEADER_BYTES, b"\x00")

    @classmethod
    def unpack(cls, data: bytes) -> "SegmentHeader | None":
        """The header data starts with; None if it does not start with one."""
        if len(data) < _LAYOUT.size or not data.startswith(MAGIC):
            return None
        _, epoch, dtype, *shape, token = _LAYOUT.unpack_from(data)
        return cls(_text(epoch), _text(dtype), tuple(shape), token)

    def mismatches(self, epoch: str, dtype: str, shape: tuple[int, ...], token: bytes) -> list[str]:
        """The names of the fields that differ from the given ones (the token compared in constant time)."""
        differ = [
            name
            for name, mine, theirs in (("epoch", self.epoch, epoch), ("dtype", self.dtype, dtype))
            if mine != theirs
        ]
        if self.shape != tuple(shape):
            differ.append("shape")
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
