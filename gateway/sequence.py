"""One request's state as it moves through the scheduler, and how far its tokens are computed.

A sequence's progress, in tokens of token_ids (prompt_ids + output_ids):

    |<----------------------------------- num_tokens ----------------------------------->|
    | computed: K/V written         | the scheduled chunk         | not scheduled yet    |
    0                      num_computed                   chunk_end             num_tokens
                           (= chunk_start)
    |<-- prefix_hit.tokens -->|     a Lookup's answer, only while no table is held: chunk_start
    |<-- cached_tokens -->|         the hits of the first Reserve, reported in the usage; fixed
    |<------ num_synced ------>|    KVView: the token ids the cache service has (may lag)
    | b0      | b1      | b2      | b3      |   the block table: blocks_for(chunk_end + lookahead)
                                                blocks; a new table's first ones are the hits

- `num_computed`: tokens whose K/V is written; a step that completes moves it to its chunk_end.
- `chunk_end`: the scheduled step computes [num_computed, chunk_end), `chunk_len` tokens; one token
  after all computed ones is a decode (`is_decode`); the step samples when chunk_end == num_tokens
  (`samples_now`). A multi-step call moves it on by one token per step.
- `chunk_start`: where the next chunk starts: num_computed, or for a sequence without a table (not
  reserved yet, or freed since) the tokens its prefix hit covers. Its first Reserve makes the table,
  sets num_computed to the hits the cache still holds (fewer than hoped when the hint went stale: the
  chunk's end moves back with it) and drops `prefix_hit`, whose job is done.
- `prefix_hit`: None until the next Lookup (again after a free, a refused Reserve, or a step whose prompt
  chunks wrote blocks the hint could not know of).
- KVView's `num_synced` lags num_computed after steps that sent no Reserve (a decode inside its last
  block, a multi-step call): the next Reserve or Free sends the missing token ids. KVView's
  `shares_tail`: forked and not reserved since, so the next write copies the shared last block.

Invariants: num_computed <= chunk_end <= num_tokens once scheduled; chunk_start == num_computed while a
table is held.
"""

import enum
import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from common.sampling_controls import CONTROLS
from gateway.structured.matcher import Matcher
from gateway.text_stream import TextStream
from gateway.vision import SeqImage


class Status(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_DEFAULT = {name: control.default for name, control in CONTROLS.items()}


@dataclass(slots=True, frozen=True)
class Sampling:
    """A request's sampling and stopping controls with every default resolved (common.sampling_controls
    declares them, in this order)."""

    max_tokens: int = _DEFAULT["max_tokens"]
    temperature: float = _DEFAULT["temperature"]
    top_k: int = _DEFAULT["top_k"]
    top_p: float = _DEFAULT["top_p"]
    min_p: float = _DEFAULT["min_p"]
    repetition_penalty: float = _DEFAULT["repetition_penalty"]
    presence_penalty: float = _DEFAULT["presence_penalty"]
    frequency_penalty: float = _DEFAULT["frequency_penalty"]
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = _DEFAULT["seed"]
    min_tokens: int = _DEFAULT["min_tokens"]
    stop_token_ids: frozenset[int] = _DEFAULT["stop_token_ids"]
    stop: tuple[str, ...] = _DEFAULT["stop"]
    ignore_eos: bool = _DEFAULT["ignore_eos"]
    # Top alternatives reported per token; None: no logprobs.
    logprobs: int | None = _DEFAULT["logprobs"]
    # Top alternatives reported per prompt token; None: no prompt logprobs.
    prompt_logprobs: int | None = _DEFAULT["prompt_logprobs"]
    n: int = _DEFAULT["n"]

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def of_sample(self, index: int) -> "Sampling":
        """Sample `index`'s controls: seeded with seed + index (mod 2**64: seeds are uint64), so that its
        draw at each position is the same wherever and whenever it runs."""
        # NOTE: unwrapped, seed 2**64 - 1 made a RowSampling that failed the whole step (INTERNAL).
        seed = None if self.seed is None else (self.seed + index) % 2**64
        # NOTE: sample 0 alone scores the prompt (the others fork after it).
        return replace(self, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)


@dataclass(slots=True, frozen=True)
class PrefixHit:
    """What a Lookup found of a sequence in the prefix cache: its leading `tokens` are computed in
    `blocks`."""

    tokens: int
    blocks: tuple[int, ...] = ()


@dataclass(slots=True)
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    sampling: Sampling
    max_len: int
    # The client's id for the request, sent to the cache and compute services in x-request-id metadata.
    request_id: str = ""
    # Lower is served first; equal priorities are served by arrival (then sample index).
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    # When the sequence's first step was scheduled (None until then).
    scheduled_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    # Progress (see the module's picture).
    num_computed: int = 0
    chunk_end: int = 0
    prefix_hit: PrefixHit | None = None
    cached_tokens: int = 0
    # Its num_computed tokens were found in the cache when its table was made, and no step has completed
    # since (ForwardRequest.cached_prefix).
    cached_prefix: bool = False
    num_preemptions: int = 0
    cache_salt: str = ""
    # The name of the API key that sent the request ("" without keys): the dashboard shows a key its own.
    tenant: str = ""
    # Which of the request's sampling.n samples this is; samples share the first one's seq_id as group_id.
    index: int = 0
    group_id: str = ""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # What the engine hands to the RPC thread: Outputs of every sample of the request, or an exception.
    outbox: queue.Queue = field(default_factory=queue.Queue)
    # The sample's detokenized text and stop strings; the engine creates it at the first token.
    text: TextStream | None = None
    # Special tokens its detokenized text keeps (the tags its tool-call and reasoning parsers read).
    keep_special: frozenset[int] = frozenset()
    # Constrained decoding: the sample's grammar matcher (None: unconstrained).
    constraint: Matcher | None = None
    # Its ForwardRequest.sparse entry, (sink, recent, topk) with topk 0 dense (gateway.sparse_request); None:
    # compute has no block-sparse decode.
    sparse: tuple[int, int, int] | None = None
    # An embedding input (gateway.pooled): the model's pooling mode ("last", "mean", "cls"), and what its
    # computed chunks pooled so far; "": a generation.
    pooling: str = ""
    pooled: np.ndarray | None = None
    # With sampling.prompt_logprobs: per prompt position, the score of its token (position 0: None), as the
    # steps of its prompt compute them.
    prompt_scores: list | None = None
    # The LoRA adapter it runs (compute's id and its name, gateway.lora; 0 and "": the base model).
    lora_id: int = 0
    lora_name: str = ""
    # The prompt's images (gateway.vision), in order: their placeholder positions and processed pixels.
    images: tuple[SeqImage, ...] = ()

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.seq_id

    @property
    def rank(self) -> tuple[int, float, int]:
        """Scheduling order: the smallest rank is served first and preempted last."""
        return self.priority, self.arrival, self.index

    @property
    def num_slots(self) -> int:
        """Running slots the sequence takes: its n samples once its prompt is done, if it is yet to fork."""
        return self.sampling.n if self.index == 0 and not self.output_ids else 1

    @property
    def chunk_start(self) -> int:
        """Where the next chunk starts: after the computed tokens, or without a table after the prefix hit."""
        return self.num_computed if self.prefix_hit is None else self.prefix_hit.tokens

    @property
    def chunk_len(self) -> int:
        """Tokens of the scheduled chunk [num_computed, chunk_end)."""
        return self.chunk_end - self.num_computed

    @property
    def scores_prompt(self) -> bool:
        """Whether its steps score its prompt tokens: asked, and its first token not sampled yet. Such a
        sequence is kept out of the prefix cache (`prefix_cached`): every prompt token is computed, so
        scored."""
        return self.sampling.prompt_logprobs is not None and not self.output_ids

    @property
    def is_decode(self) -> bool:
        """Whether the scheduled chunk is one token after all the computed ones: a decode."""
        return self.chunk_len == 1

    @property
    def samples_now(self) -> bool:
        """Whether the scheduled chunk reaches the last token, so that the step samples the next one (an
        embedding input never samples)."""
        return self.chunk_end == self.num_tokens and not self.pooling

    @property
    def pools_now(self) -> bool:
        """Whether the step pools the scheduled chunk's hidden states: an embedding input's chunk that holds
        its last token (last), its first (cls), or any chunk (mean)."""
        if self.pooling == "last":
            return self.chunk_end == self.num_tokens
        return self.pooling == "mean" or (self.pooling == "cls" and self.num_computed == 0)

    @property
    def prefix_cached(self) -> bool:
        """Whether its prompt shares the prefix cache (looks cached blocks up, leaves its own there). An
        embedding input pooled by mean or CLS needs every token's hidden state, so it computes them all and
        keeps nothing cached; one pooled by its last token reuses cached blocks as a prompt does (exact:
        the last token's hidden state sees the others only through their K/V). A prompt being scored
        (`scores_prompt`) computes every token too."""
        return self.pooling in ("", "last") and not self.scores_prompt

    @property
    def forks_now(self) -> bool:
        """Whether the step samples the first token of a request of n > 1 samples: the others fork now."""
        return self.sampling.n > 1 and self.index == 0 and not self.output_ids and self.samples_now

    def fork(self) -> list["Sequence"]:
        """Samples 1..n-1 of the request, made after its prompt's prefill: each shares the prompt (and,
        once the cache service forks them, its blocks) and recomputes the last prompt token to sample its
        own first token."""
        assert self.index == 0 and not self.output_ids, (self.seq_id, self.index)
        return [
            self.sample(index, num_computed=self.num_tokens - 1, chunk_end=0, num_preemptions=0)
            for index in range(1, self.sampling.n)
        ]

    def sample(self, index: int, **changes) -> "Sequence":
        """The request's sample `index` (this sequence being sample 0), no token generated yet: seeded with
        seed + index, its constraint at its start; `changes` as dataclasses.replace takes them."""
        fields = {
            "seq_id": self.sample_id(index),
            "index": index,
            "sampling": self.sampling.of_sample(index),
            "output_ids": [],
            "constraint": self.constraint and self.constraint.fresh(),
        }
        return replace(self, **{**fields, **changes})

    def sample_id(self, index: int) -> str:
        """The seq_id of the request's sample `index` (this sequence being sample 0)."""
        return f"{self.group_id}/{index}" if index else self.group_id

    def drop_kv(self) -> None:
        """After its blocks are freed: nothing is computed any more (the tokens are kept), and what the
        prefix cache holds of it is to be looked up again."""
        self.num_computed = self.chunk_end = 0
        self.pooled = None
        self.forget_prefix()

    def forget_prefix(self) -> None:
        """What the prefix cache holds of it is to be looked up again (the Lookup's answer may be stale)."""
        self.prefix_hit = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_token_ids(self) -> list[int]:
        """token_ids as the cache service hashes them: an image's placeholder positions hold ids drawn from
        its digest (gateway.vision)."""
        if not self.images:
            return self.token_ids
        ids = self.token_ids
        for image in self.images:
            ids[image.offset : image.end] = image.cache_ids
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def stop_reason(self, eos_ids: frozenset[int]) -> str | None:
        """Why the sequence ends after its latest token, or None to go on."""
        last, sampling = self.output_ids[-1], self.sampling
        is_stop = last in sampling.stop_token_ids or (not sampling.ignore_eos and last in eos_ids)
        if is_stop and self.reached_min_tokens:
            return "stop"
        if self.constraint is not None and self.constraint.stopped:
            return "stop"  # the constraint is complete: nothing else may follow
        if len(self.output_ids) >= self.sampling.max_tokens or self.num_tokens >= self.max_len:
            return "length"
        return None

    @property
    def tokens_left(self) -> int:
        """Tokens the sequence may still sample: its max_tokens and the longest sequence bound it."""
        return min(self.sampling.max_tokens - len(self.output_ids), self.max_len - self.num_tokens)

    def lookahead(self, steps: int) -> int:
        """Slots a call of up to `steps` decode steps writes past the chunk: one per later step the sequence
        may still take (none past its tokens_left)."""
        return max(0, min(steps, self.tokens_left) - 1)

    @property
    def reached_min_tokens(self) -> bool:
        """Whether EOS, stop token ids and stop strings may end the sequence now."""
        return len(self.output_ids) >= self.sampling.min_tokens
