"""A sequence as the cache service sees it: what a request asks for, and what the service keeps."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cache_service.prefix_cache import BlockHash


class SeqRequest(NamedTuple):
    """A sequence, the tokens it must hold after the call, and its progress.

    token_ids: on allocate the whole sequence, on extend the tokens appended since the previous call; empty
    for a sequence that is never prefix-cached. num_computed (extend): leading tokens whose K/V is written;
    the step that follows writes [num_computed, num_tokens).
    """

    seq_id: str
    num_tokens: int
    token_ids: Sequence[int] = ()
    num_computed: int = 0
    cache_salt: str = ""


@dataclass(slots=True)
class SeqState:
    """A sequence's block table and, when it is prefix-cached, its tokens and the hash chain of its leading
    full, written blocks (`hashes[i]` names block i, whether or not the index kept that very block)."""

    num_tokens: int
    root: BlockHash
    token_ids: list[int] | None  # None: not prefix-cached
    block_table: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    cached_tokens: int = 0
