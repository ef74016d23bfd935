"""Compiling constraints: the model's tokenizer wrapped once for the grammar engine (llguidance), each
constraint compiled into a matcher at its initial state under a time limit, and compiled matchers cached by
content (a new sample starts from a copy of one)."""

import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import llguidance
import structlog
from prometheus_client import Histogram

from common.errors import FailedPrecondition, InvalidArgument
from common.metrics import LATENCY_BUCKETS
from gateway.structured.limits import ConstraintLimits
from gateway.structured.matcher import Matcher
from gateway.structured.spec import Spec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = structlog.get_logger()
COMPILE_SECONDS = Histogram(
    "pagedserve_grammar_compile_seconds",
    "Compiling one constraint that was not cached (the engine's parser built with the tokenizer).",
    buckets=LATENCY_BUCKETS,
)
# Compiled constraints kept (least recently used dropped first).
CACHE_ENTRIES = 256
# Threads that compile; a compile past its time limit keeps its thread until the engine's own limits
# (PARSER_LIMITS) end it.
COMPILE_THREADS = 2
# llguidance's resource limits: the work of one compile and of one token's mask is bounded by them.
# A line of the engine's error messages that quotes the grammar: `  12 | start: ...`.
SOURCE_LINE = re.compile(r"^\d+ \|")
PARSER_LIMITS = {"max_grammar_size": 200_000, "max_lexer_states": 50_000, "initial_lexer_fuel": 1_000_000}


class Grammars:
    """One per gateway: `matcher(spec)` gives a sample its matcher, or raises InvalidArgument naming what is
    wrong with the constraint (invalid, unsupported, over the limits, too slow to compile)."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", limits: ConstraintLimits) -> None:
        self._hf = tokenizer
        self.limits = limits
        self._compile_ms = limits.max_constraint_compile_ms
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)

    def prepare(self, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
        """The engine's tokenizer for a model of this vocabulary (built once, slowly: call it at start-up).
        FailedPrecondition if the engine cannot hold this tokenizer for this model (a vocabulary smaller than
        the tokenizer's)."""
        with self._lock:
            if self._tokenizer is None or self._tokenizer.vocab_size != vocab_size:
                # NOTE: imported here: it imports transformers, which gateway.tokenizer.load imports first.
                import llguidance.hf

                start = time.perf_counter()
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf, n_vocab=vocab_size, eos_token=eos_ids
                    )
                except ValueError as err:
                    raise FailedPrecondition(
                        f"constraints are unavailable with this model and tokenizer: {err}"
                    ) from None
                self._cache.clear()
                log.info("grammar_tokenizer", vocab=vocab_size, seconds=round(time.perf_counter() - start, 3))
            return self._tokenizer

    def prepare_at_start(self, vocab_size: int, eos_ids: list[int]) -> None:
        """prepare, logging instead of raising when the model cannot take constraints (its requests that
        ask for one are refused with the reason)."""
        try:
            self.prepare(vocab_size, eos_ids)
        except FailedPrecondition as err:
            log.warning("grammar_tokenizer_unavailable", vocab=vocab_size, error=str(err))

    def matcher(self, spec: Spec, vocab_size: int, eos_ids: list[int]) -> Matcher:
        """A matcher at the constraint's start, from the cache or compiled within the time limit."""
        tokenizer = self.prepare(vocab_size, eos_ids)
        with self._lock:
            template = self._cache.get(spec.key)
            if template is not None:
                self._cache.move_to_end(spec.key)
                return Matcher(template.deep_copy(), vocab_size, eos_ids)
        future = self._pool.submit(self._compile, spec, tokenizer)
        try:
            template = future.result(timeout=self._compile_ms / 1e3)
        except FutureTimeout:
            log.warning("grammar_compile_slow", kind=spec.kind, limit_ms=self._compile_ms)
            raise InvalidArgument(
                f"constraint.{spec.kind} did not compile within {self._compile_ms} ms "
                "(--max-constraint-compile-ms): simplify it"
            ) from None
        with self._lock:
            self._cache[spec.key] = template
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return Matcher(template.deep_copy(), vocab_size, eos_ids)

    def _compile(self, spec: Spec, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        start = time.perf_counter()
        try:
            grammar = spec.grammar()
        except ValueError as err:  # the JSON of a schema that is no object, for one
            raise InvalidArgument(f"constraint.{spec.kind}: {err}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
        COMPILE_SECONDS.observe(time.perf_counter() - start)
        if matcher.is_error():
            raise InvalidArgument(f"constraint.{spec.kind} is not supported: {_message(matcher.get_error())}")
        return matcher


def _message(error: str) -> str:
    """The engine's message on one line, without its source excerpts (`1 | ...` and carets)."""
    lines = [line.strip() for line in error.splitlines()]
    kept = [line for line in lines if line and not SOURCE_LINE.match(line) and set(line) != {"^"}]
    return " ".join(kept)[:500] or "the grammar engine refused it"
