"""A sequence as the cache service sees it: what a request asks for, and what the service keeps."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cache_service.prefix_cache import BlockHash
from common.errors import InvalidArgument


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

    def check_extend(self, request: SeqRequest, block_size: int) -> None:
        """InvalidArgument unless `request` grows this sequence consistently: no shrinking, new token ids
        (if it is prefix-cached) that add up to num_tokens, and num_computed not below its hashed blocks."""
        name = repr(request.seq_id)
        if request.num_tokens < self.num_tokens:
            raise InvalidArgument(
                f"sequence {name} holds {self.num_tokens} tokens: Extend cannot shrink it to "
                f"{request.num_tokens} (Free it and Allocate again)"
            )
        new = len(request.token_ids)
        held = self.num_tokens if self.token_ids is not None else request.num_tokens - new
        if held + new != request.num_tokens:
            raise InvalidArgument(
                f"sequence {name}: {new} new token_ids take it from {held} to {held + new} tokens, "
                f"not num_tokens {request.num_tokens}"
            )
        if not len(self.hashes) * block_size <= request.num_computed <= request.num_tokens:
            raise InvalidArgument(
                f"sequence {name}: num_computed {request.num_computed} must be in "
                f"[{len(self.hashes) * block_size}, {request.num_tokens}]"
            )


def check_request(request: SeqRequest) -> None:
    """InvalidArgument for an empty seq_id or num_tokens <= 0."""
    if not request.seq_id:
        raise InvalidArgument("seq_id must not be empty")
    if request.num_tokens <= 0:
        name, n = request.seq_id, request.num_tokens
        raise InvalidArgument(f"sequence {name!r}: num_tokens must be > 0, got {n}")
