"""One sample's grammar matcher: which tokens it may sample next, as a packed bitmask, and the tokens it
sampled. Masks are filled ahead: once a step's tokens are accepted, one background job fills the next masks
of all its constrained samples (llguidance's parallel fill, without the GIL) while the engine thread
detokenizes, schedules and reserves the next step; the Forward request then only collects them.

NOTE: the state is the sampled tokens alone, so it survives preemption and recompute as the tokens do."""

import time
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import numpy as np
import structlog
from prometheus_client import Histogram

from common.metrics import LATENCY_BUCKETS

log = structlog.get_logger()
MASK_SECONDS = Histogram(
    "pagedserve_grammar_mask_seconds", "Filling the next masks of one step's constrained samples.",
    buckets=(0.0001, 0.0005, *LATENCY_BUCKETS),
)  # fmt: skip
WAIT_SECONDS = Histogram(
    "pagedserve_grammar_mask_wait_seconds",
    "What a step's Forward request waited for masks still being filled.",
    buckets=(0.0001, 0.0005, *LATENCY_BUCKETS),
)
_FILLER = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
_EXECUTOR = llguidance.LLExecutor()


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Matcher:
    """Follows one sample. `mask()` is the packed bitmask of the tokens allowed now; `accept(token)` after
    each sampled token; `stopped` once the constraint is complete (or the engine failed it)."""

    __slots__ = ("_matcher", "_initial", "_vocab", "_eos", "_mask", "_job")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: list[int]) -> None:
        self._matcher = matcher
        self._initial = matcher.deep_copy()
        self._vocab, self._eos = vocab_size, eos_ids
        self._mask: np.ndarray | None = None
        self._job: Future | None = None

    def fresh(self) -> "Matcher":
        """A matcher at the constraint's start, for another sample of the same request."""
        return Matcher(self._initial.deep_copy(), self._vocab, self._eos)

    @property
    def stopped(self) -> bool:
        return self._matcher.is_stopped() or self._matcher.is_error()

    def accept(self, token: int) -> None:
        """The sample's next token (one its mask allowed)."""
        assert self._job is None, "a mask is being filled: collect it before accepting a token"
        self._mask = None
        if not self._matcher.consume_token(token):
            log.warning("constraint_failed", token=token, error=self._matcher.get_error()[:300])

    def mask(self) -> np.ndarray:
        """The allowed tokens now: [words(vocab_size)] int32, token t at bit t % 32 of word t // 32."""
        if self._job is not None:
            start = time.perf_counter()
            self._job.result()
            WAIT_SECONDS.observe(time.perf_counter() - start)
            self._job = None
        if self._mask is None:
            fill([self])
        return self._mask

    def _set(self, row: np.ndarray) -> None:
        if self._matcher.is_error():
            # NOTE: the engine's limits ended the match: only EOS remains, so the sample ends.
            log.warning("constraint_failed", error=self._matcher.get_error()[:300])
            bits = row.view(np.uint32)
            bits[:] = 0
            for token in self._eos:
                bits[token // 32] |= np.uint32(1 << token % 32)
        self._mask = row


def fill(matchers: list[Matcher]) -> None:
    """Fills the masks of `matchers` now (in parallel, the GIL released)."""
    if not matchers:
        return
    start = time.perf_counter()
    masks = llguidance.numpy.allocate_token_bitmask(len(matchers), matchers[0]._vocab)
    llguidance.numpy.fill_next_token_bitmask_par(
        _EXECUTOR, [(m._matcher, i) for i, m in enumerate(matchers)], masks
    )
    for matcher, row in zip(matchers, masks, strict=True):
        matcher._set(row)
    MASK_SECONDS.observe(time.perf_counter() - start)


def prefetch(matchers: list[Matcher]) -> None:
    """Starts filling the masks of `matchers` in the background; each `mask()` collects its own."""
    todo = [m for m in matchers if m._mask is None and m._job is None]
    if todo:
        job = _FILLER.submit(fill, todo)
        for matcher in todo:
            matcher._job = job


def packed(matchers: list[Matcher]) -> bytes:
    """The masks of `matchers`, row after row, as ForwardRequest.constraint_bitmask."""
    return b"".join(m.mask().tobytes() for m in matchers)
