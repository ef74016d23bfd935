"""vLLM's KV event wire format (vllm/distributed/kv_events.py, vLLM 0.32), encoded with msgspec as vLLM does.

A message is three ZMQ frames: the topic, the batch's sequence number (8 bytes, big-endian, from 0 in each
process) and the batch in msgpack. The batch is an array [ts, events, data_parallel_rank]; each event is a map
tagged by its "type": BlockStored, BlockRemoved or AllBlocksCleared. Block hashes are the prefix index's
16-byte chained digests (msgpack bin), which consumers read as vLLM's bytes hashes.
"""

import msgspec

# vLLM's medium of the engine's own KV pool (its CPU engine reports it too); tiers are not published.
MEDIUM = "GPU"
# One KV cache group: every layer shares the block tables.
GROUP = 0
# A replay answer's last message has this sequence number (-1) and empty topic and payload.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Full blocks of one sequence, in order, entered the prefix index: token_ids are theirs end to end;
    parent_block_hash is the block before the first (None: they start the sequence)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks left the prefix index (evicted to make room)."""

    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Every block this publisher announced is gone (a new pool, or the service stopping)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def stored(
    block_hash: bytes,
    parent: bytes | None,
    token_ids: list[int],
    block_size: int,
    lora: tuple[int, str] | None = None,
) -> BlockStored:
    """A block's BlockStored; `lora`: the (lora_id, lora_name) of the adapter its K/V ran through (None:
    the base model's, both fields None as vLLM sends them)."""
    lora_id, lora_name = lora if lora is not None else (None, None)
    return BlockStored([block_hash], parent, token_ids, block_size, lora_id, MEDIUM, lora_name, GROUP)


def removed(block_hash: bytes) -> BlockRemoved:
    return BlockRemoved([block_hash], MEDIUM, GROUP)


def sequence_number(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
