"""What a tier holds for one block: its key (the pool's fingerprint + the block's chained prefix hash) and its
record (a header with the payload's length and blake2b digest, then the block's K/V bytes)."""

import hashlib
import struct

from cache_service.prefix_cache import BlockHash
from common import shared_pool
from common.shared_pool import PoolSpec

MAGIC = b"PSKV"
VERSION = 1
# magic, version, 3 bytes padding, payload length, blake2b-16 digest of the payload
HEADER = struct.Struct("<4sB3xQ16s")
FINGERPRINT_BYTES = 8


class CorruptRecord(ValueError):
    """A record whose header, length or checksum does not match: it is never served."""


def fingerprint(spec: PoolSpec) -> bytes:
    """The layout a block's bytes are only valid in: geometry, block size and dtype. The model's identity
    and the request's cache_salt are in the block hash already (prefix_cache.root_hash)."""
    layout = (
        f"v{VERSION}|layers={spec.num_layers}|kv_heads={spec.num_kv_heads}|head_dim={spec.head_dim}|"
        f"block_size={spec.block_size}|dtype={shared_pool.dtype_name(spec.dtype)}"
    )
    return hashlib.blake2b(layout.encode(), digest_size=FINGERPRINT_BYTES).digest()


def key(fingerprint_: bytes, hash_: BlockHash) -> bytes:
    assert len(fingerprint_) == FINGERPRINT_BYTES, fingerprint_
    return fingerprint_ + hash_


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode(payload: bytes | memoryview) -> bytes:
    """The record of a payload (bytes, or a flat byte memoryview)."""
    return HEADER.pack(MAGIC, VERSION, len(payload), _digest(payload)) + payload


def decode(record: bytes, payload_bytes: int) -> memoryview:
    """The payload of a record that holds exactly payload_bytes and matches its checksum (a view of the
    record); CorruptRecord (naming what is wrong) otherwise."""
    if len(record) < HEADER.size:
        raise CorruptRecord(f"record of {len(record)} bytes is shorter than its header ({HEADER.size})")
    magic, version, length, digest = HEADER.unpack_from(record)
    if (magic, version) != (MAGIC, VERSION):
        raise CorruptRecord(f"not a version-{VERSION} block record (magic {magic!r}, version {version})")
    payload = memoryview(record)[HEADER.size :]
    if not length == len(payload) == payload_bytes:
        raise CorruptRecord(
            f"payload of {len(payload)} bytes, header says {length}, a block takes {payload_bytes}"
        )
    if _digest(payload) != digest:
        raise CorruptRecord("payload checksum mismatch")
    return payload
