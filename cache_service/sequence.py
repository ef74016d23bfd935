"""A sequence as the cache service sees it: what a Reserve asks for, what the service keeps, and the checks
that refuse a whole batch before anything changes."""

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cache_service.prefix_cache import BlockHash, LoraTag
from common.errors import AlreadyExists, InvalidArgument, NotFound
from common.paging import blocks_for

# NOTE: bounds the blocks one Reserve may take past a running sequence's tokens (multi-step decode's steps).
MAX_LOOKAHEAD_TOKENS = 64


class SeqRequest(NamedTuple):
    """A sequence, the tokens it must hold after the call, and its progress.

    token_ids: for a new sequence the whole sequence, for a running one the tokens appended since the
    previous call; empty for a sequence that is never prefix-cached. num_computed (running): leading tokens
    whose K/V is written; the step that follows writes [num_computed, num_tokens). max_compute (new, > 0):
    the step computes at most that many tokens after the prefix hits (`BlockManager.fit` trims num_tokens).
    lookahead (running, 0..MAX_LOOKAHEAD_TOKENS): the table also holds blocks for that many tokens past
    num_tokens, the slots a multi-step decode writes before their tokens are known.
    """

    seq_id: str
    num_tokens: int
    token_ids: Sequence[int] = ()
    num_computed: int = 0
    cache_salt: str = ""
    max_compute: int = 0
    lookahead: int = 0
    # the LoRA adapter the sequence runs (compute's id, its name; 0 and "": the base model)
    lora_id: int = 0
    lora_name: str = ""

    @property
    def adapter(self) -> str:
        """The adapter's part of the sequence's prefix root (prefix_cache.root_hash): empty for the base."""
        return f"{self.lora_id}:{self.lora_name}" if self.lora_id else ""


@dataclass(frozen=True, slots=True)
class TableTail:
    """A block table from index `first` on (the entries before it are unchanged), and for a new sequence
    its leading tokens found computed (prefix hits) and the tokens it holds."""

    first: int
    block_ids: list[int]
    cached_tokens: int = 0
    num_tokens: int = 0


@dataclass(slots=True)
class SeqState:
    """A sequence's block table and, when it is prefix-cached, its tokens and the hash chain of its leading
    full blocks (`hashes[i]` names block i, whether or not the index kept that very block).
    NOTE: the table may hold lookahead blocks past those of num_tokens; it never shrinks."""

    num_tokens: int
    root: BlockHash
    token_ids: list[int] | None  # None: not prefix-cached
    block_table: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    cached_tokens: int = 0
    # the LoRA adapter its KV runs through (SeqRequest.lora_id, lora_name); None: the base model
    lora: LoraTag | None = None

    @property
    def last_hash(self) -> BlockHash:
        """The hash the chain goes on from: the last hashed block's, or the root."""
        return self.hashes[-1] if self.hashes else self.root

    def check_invariants(self, seq_id: str, block_size: int, null_block: int = -1) -> None:
        """Asserts: the table holds no block twice (null_block, a released entry, aside), the blocks for
        num_tokens and at most the lookahead limit's more; tokens all kept."""
        table, n = self.block_table, self.num_tokens
        held = [block_id for block_id in table if block_id != null_block]
        assert len(set(held)) == len(held), f"sequence {seq_id!r} holds a block twice: {table}"
        low, high = blocks_for(n, block_size), blocks_for(n + MAX_LOOKAHEAD_TOKENS, block_size)
        assert low <= len(table) <= high, (seq_id, n, table)
        assert self.token_ids is None or len(self.token_ids) == self.num_tokens, seq_id

    def growth(self, request: SeqRequest, block_size: int) -> int:
        """Blocks the table lacks for the request's num_tokens plus lookahead (0 when it holds them)."""
        return max(0, blocks_for(request.num_tokens + request.lookahead, block_size) - len(self.block_table))

    def append(self, tokens: Sequence[int]) -> None:
        """Tokens the sequence gained into its table's free slots (checked by the caller)."""
        self.num_tokens += len(tokens)
        if self.token_ids is not None:
            self.token_ids.extend(tokens)

    def check_grow(self, request: SeqRequest, block_size: int) -> None:
        """InvalidArgument unless `request` grows this sequence consistently: no shrinking, new token ids
        (if it is prefix-cached) that add up to num_tokens, and num_computed not below its hashed blocks."""
        name = repr(request.seq_id)
        if request.num_tokens < self.num_tokens:
            raise InvalidArgument(
                f"sequence {name} holds {self.num_tokens} tokens: Reserve cannot shrink it to "
                f"{request.num_tokens} (Free it and Reserve it again as new)"
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


# batch checks: each raises before anything changes


def check_request(request: SeqRequest) -> None:
    """InvalidArgument for an empty seq_id, num_tokens <= 0, max_compute < 0 or lookahead out of range."""
    if not request.seq_id:
        raise InvalidArgument("seq_id must not be empty")
    if request.num_tokens <= 0:
        name, n = request.seq_id, request.num_tokens
        raise InvalidArgument(f"sequence {name!r}: num_tokens must be > 0, got {n}")
    if request.max_compute < 0:
        name, n = request.seq_id, request.max_compute
        raise InvalidArgument(f"sequence {name!r}: max_compute_tokens must be >= 0, got {n}")
    if not 0 <= request.lookahead <= MAX_LOOKAHEAD_TOKENS:
        name, n = request.seq_id, request.lookahead
        raise InvalidArgument(
            f"sequence {name!r}: lookahead_tokens must be in [0, {MAX_LOOKAHEAD_TOKENS}], got {n}"
        )


def check_known(seq_ids: Sequence[str], seqs: Mapping[str, SeqState]) -> None:
    """NotFound for any sequence without a table."""
    unknown = sorted({seq_id for seq_id in seq_ids if seq_id not in seqs})
    if unknown:
        raise NotFound(f"unknown sequences {unknown}: Reserve them as new first (or they were freed)")


def check_progress(num_computed: Mapping[str, int], seqs: Mapping[str, SeqState]) -> None:
    """NotFound (a sequence without a table) or InvalidArgument (a negative count)."""
    check_known(list(num_computed), seqs)
    negative = sorted(seq_id for seq_id, computed in num_computed.items() if computed < 0)
    if negative:
        raise InvalidArgument(f"sequences {negative}: num_computed must not be negative")


def check_prompt(request: SeqRequest) -> None:
    """InvalidArgument (bad request, lookahead on a new sequence, token_ids neither empty nor num_tokens
    long)."""
    check_request(request)
    if request.lookahead:
        raise InvalidArgument(
            f"sequence {request.seq_id!r}: lookahead_tokens must be 0 for a new sequence (running sequences "
            f"take [0, {MAX_LOOKAHEAD_TOKENS}]), got {request.lookahead}"
        )
    if request.token_ids and len(request.token_ids) != request.num_tokens:
        raise InvalidArgument(
            f"sequence {request.seq_id!r}: {len(request.token_ids)} token_ids for num_tokens "
            f"{request.num_tokens}; give every token or none"
        )


def check_new(requests: Sequence[SeqRequest], seqs: Mapping[str, SeqState]) -> None:
    """InvalidArgument (bad request, token_ids not num_tokens long) or AlreadyExists (the sequence has a
    table or is listed twice)."""
    seen: set[str] = set()
    for request in requests:
        check_prompt(request)
        if request.seq_id in seqs:
            raise AlreadyExists(
                f"sequence {request.seq_id!r} already has a block table: Reserve it as running, or Free it"
            )
        if request.seq_id in seen:
            raise AlreadyExists(f"sequence {request.seq_id!r} is listed twice in one Reserve")
        seen.add(request.seq_id)


def check_running(requests: Sequence[SeqRequest], seqs: Mapping[str, SeqState], block_size: int) -> None:
    """InvalidArgument (bad request or growth, listed twice) or NotFound (no table)."""
    for request in requests:
        check_request(request)
    check_known([request.seq_id for request in requests], seqs)
    seen: set[str] = set()
    for request in requests:
        if request.seq_id in seen:
            raise InvalidArgument(f"sequence {request.seq_id!r} is listed twice in one Reserve")
        seen.add(request.seq_id)
        seqs[request.seq_id].check_grow(request, block_size)


def check_fork(parent_id: str, child_ids: Sequence[str], seqs: Mapping[str, SeqState]) -> None:
    """NotFound (unknown parent), InvalidArgument (empty or repeated child id) or AlreadyExists (a child
    has a table)."""
    check_known([parent_id], seqs)
    if len(set(child_ids)) != len(child_ids) or not all(child_ids):
        raise InvalidArgument(f"child ids must be distinct and non-empty, got {list(child_ids)}")
    taken = sorted(child_id for child_id in child_ids if child_id in seqs)
    if taken:
        raise AlreadyExists(f"sequences {taken} already have block tables")


def check_free(
    seq_ids: Sequence[str],
    num_computed: Mapping[str, int],
    seqs: Mapping[str, SeqState],
    appended: Mapping[str, Sequence[int]],
    block_size: int,
) -> None:
    """NotFound (no table) or InvalidArgument (listed twice, num_computed or appended tokens for a sequence
    not freed, num_computed out of range, appended tokens beyond the table)."""
    check_known([*seq_ids, *num_computed, *appended], seqs)
    twice = sorted(seq_id for seq_id, count in Counter(seq_ids).items() if count > 1)
    if twice or (set(num_computed) | set(appended)) - set(seq_ids):
        raise InvalidArgument(f"sequences {twice} are listed twice in one Free, or not freed")
    for seq_id, tokens in appended.items():
        seq = seqs[seq_id]
        end, slots = seq.num_tokens + len(tokens), len(seq.block_table) * block_size
        if end > slots:
            raise InvalidArgument(
                f"sequence {seq_id!r}: {len(tokens)} appended tokens take it to {end} tokens, beyond its "
                f"table's {slots} slots"
            )
    for seq_id, computed in num_computed.items():
        if not 0 <= computed <= seqs[seq_id].num_tokens + len(appended.get(seq_id, ())):
            raise InvalidArgument(f"sequence {seq_id!r}: num_computed {computed} is out of range")
