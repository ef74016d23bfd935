"""Sampling over the packed batch: penalties, logit bias, min_tokens, constraint masks, then temperature,
top-k, top-p and min-p from one sort, per-row seeds; log-probabilities of the raw logits."""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.sampling_controls import CONTROLS, ROW_CONTROLS, Kind, read
from compute_service import constraints
from protos import compute_pb2

if TYPE_CHECKING:
    from compute_service.prompt_logprobs import PromptScores


def _floats(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _ints(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# The numeric per-row controls with a default: one tensor each, named after the control.
NUMBER_CONTROLS = tuple(
    c.name for c in ROW_CONTROLS if c.kind in (Kind.FLOAT, Kind.INT) and c.default is not None
)


def _column(params: Sequence[compute_pb2.RowSampling], name: str) -> torch.Tensor:
    control = CONTROLS[name]
    values = [read(p, control) for p in params]
    return _floats(values) if control.kind is Kind.FLOAT else _ints(values)


@dataclass(slots=True)
class SamplingBatch:
    """One row per sequence that samples this step; the request's fields as tensors, unchecked."""

    # the numeric controls, unset ones at their declared defaults (common.sampling_controls)
    temperature: torch.Tensor  # [S] float32
    top_p: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64
    min_p: torch.Tensor  # [S] float32
    repetition_penalty: torch.Tensor  # [S] float32
    presence_penalty: torch.Tensor  # [S] float32
    frequency_penalty: torch.Tensor  # [S] float32
    min_tokens: torch.Tensor  # [S] int64
    seeds: list[int | None]
    wants_logprobs: torch.Tensor  # [S] bool: logprobs is set
    logprobs: torch.Tensor  # [S] int64; top alternatives asked for (0 when unset)
    # logit_bias and the suppressed ids, flattened over rows: (row, token id[, bias]) per entry
    bias_rows: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    suppress_rows: torch.Tensor
    suppress_ids: torch.Tensor
    # the penalties' token history (see ForwardRequest) and the generated counts (empty: none sent)
    history: torch.Tensor
    cu_history: torch.Tensor
    history_prompt_lens: torch.Tensor
    output_lens: torch.Tensor
    # constrained rows (ascending) and the tokens each may not sample, [M, 32 * words] (see constraints.py)
    constraint_rows: torch.Tensor
    blocked: torch.Tensor

    @property
    def constrained(self) -> bool:
        return bool(len(self.constraint_rows))

    @classmethod
    def from_request(cls, request: compute_pb2.ForwardRequest) -> "SamplingBatch":
        return cls.from_params(
            request.sampling,
            history=request.history_token_ids,
            cu_history=request.cu_history,
            history_prompt_lens=request.history_prompt_lens,
            output_lens=request.output_lens,
            constraint_rows=request.constraint_rows,
            constraint_bitmask=request.constraint_bitmask,
        )

    @classmethod
    def from_params(
        cls,
        params: Sequence[compute_pb2.RowSampling],
        *,
        history: Sequence[int] = (),
        cu_history: Sequence[int] = (),
        history_prompt_lens: Sequence[int] = (),
        output_lens: Sequence[int] = (),
        constraint_rows: Sequence[int] = (),
        constraint_bitmask: bytes = b"",
    ) -> "SamplingBatch":
        bias = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias.items()]
        suppress = [
            (row, t) for row, p in enumerate(params) if p.min_tokens > 0 for t in p.suppress_token_ids
        ]
        rows, blocked = constraints.unpack(constraint_rows, constraint_bitmask)
        return cls(
            **{name: _column(params, name) for name in NUMBER_CONTROLS},
            seeds=[p.seed if p.HasField("seed") else None for p in params],
            wants_logprobs=torch.tensor([p.HasField("logprobs") for p in params], dtype=torch.bool),
            logprobs=_ints([p.logprobs for p in params]),
            bias_rows=_ints([row for row, _, _ in bias]),
            bias_ids=_ints([t for _, t, _ in bias]),
            bias_values=_floats([b for _, _, b in bias]),
            suppress_rows=_ints([row for row, _ in suppress]),
            suppress_ids=_ints([t for _, t in suppress]),
            history=_ints(history),
            cu_history=_ints(cu_history),
            history_prompt_lens=_ints(history_prompt_lens),
            output_lens=_ints(output_lens),
            constraint_rows=rows,
            blocked=blocked,
        )

    def following(self, tokens: torch.Tensor, keep: torch.Tensor | None) -> "SamplingBatch":
        """The next decode step's rows `keep` ([K] int64, ascending; None: all), each row having sampled its
        token in `tokens` [S]: a penalized row's history gains it, the generated counts grow by one. No row is
        constrained (ForwardSteps refuses those: the gateway's matchers choose each step's masks)."""
        assert not len(self.constraint_rows), "constrained rows run one step per call"

        def pick(values: torch.Tensor) -> torch.Tensor:
            return values if keep is None else values[keep]

        history, cu_history, prompt_lens = (
            self._grown_history(tokens, torch.arange(len(self.seeds)) if keep is None else keep)
            if len(self.cu_history)
            else (self.history, self.cu_history, self.history_prompt_lens)
        )
        return SamplingBatch(
            **{name: pick(getattr(self, name)) for name in (*NUMBER_CONTROLS, "wants_logprobs", "logprobs")},
            seeds=self.seeds if keep is None else [self.seeds[i] for i in keep.tolist()],
            **self._entries(("bias_rows", "bias_ids", "bias_values"), keep),
            **self._entries(("suppress_rows", "suppress_ids"), keep),
            history=history,
            cu_history=cu_history,
            history_prompt_lens=prompt_lens,
            output_lens=pick(self.output_lens) + 1 if len(self.output_lens) else self.output_lens,
            constraint_rows=self.constraint_rows,
            blocked=self.blocked,
        )

    def _entries(self, names: tuple[str, ...], keep: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The per-entry tensors `names` (rows first: the logit bias or the suppressed ids) of the rows
        `keep`, renumbered."""
        entries = {name: getattr(self, name) for name in names}
        if keep is None or not len(entries[names[0]]):
            return entries
        new_row = torch.full((len(self.seeds),), -1)
        new_row[keep] = torch.arange(len(keep))
        rows = new_row[entries[names[0]]]
        kept = rows >= 0
        return {names[0]: rows[kept], **{name: entries[name][kept] for name in names[1:]}}

    def _grown_history(self, tokens: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """History, offsets and prompt lengths of `rows`, each penalized row's sampled token appended."""
        penalized = (
            (self.repetition_penalty != 1) | (self.presence_penalty != 0) | (self.frequency_penalty != 0)
        )
        starts, lens = self.cu_history[:-1][rows], self.cu_history.diff()[rows]
        new_lens = lens + penalized[rows]
        cu = torch.cat([new_lens.new_zeros(1), new_lens.cumsum(0)])
        row = torch.repeat_interleave(torch.arange(len(rows)), new_lens, output_size=int(cu[-1]))
        offset = torch.arange(len(row)) - cu[:-1][row]
        # NOTE: an entry kept comes from its old place; an appended one is its row's token, after the history.
        source = torch.where(offset < lens[row], starts[row] + offset, len(self.history) + rows[row])
        return torch.cat([self.history, tokens])[source], cu, self.history_prompt_lens[rows]


@dataclass(slots=True)
class Sampled:
    tokens: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] float32, of the raw logits
    top_ids: torch.Tensor  # [rows asking for logprobs, width] int64, most likely first
    top_logprobs: torch.Tensor  # [rows asking for logprobs, width] float32
    # [rows with pool set, hidden] float32: their pooled hidden states (compute_service.pooling); None: no row
    # pools. Set by the runner, beside the sampled rows.
    pooled: torch.Tensor | None = None
    # the step's prompt targets' scores (compute_service.prompt_logprobs); None: no row asked
    prompt: "PromptScores | None" = None


def sample(logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor) -> Sampled:
    """logits [S, V] float32 (raw model output) -> sampled tokens and log-probabilities.

    `positions` [S] are the positions the sampled tokens will take; a seeded row draws from a generator
    derived from (seed, position) alone, so it samples the same token whatever else is in the batch.
    """
    assert logits.dim() == 2 and len(logits) == len(batch.temperature) == len(positions) == len(batch.seeds)
    raw_logprobs = logits.log_softmax(dim=-1)
    logits = process(logits, batch)
    # NOTE: max's indices (the first maximum, as argmax's): several times faster than argmax on the cpu
    # (tools/structured_overhead.py --parts times the masked path).
    tokens = logits.max(dim=-1).indices
    rows = (batch.temperature > 0).nonzero().squeeze(1)
    if len(rows):
        scaled = logits[rows] / batch.temperature[rows, None]
        probs = _filter(scaled, batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]).softmax(dim=-1)
        noise = _exponential_noise(
            probs.shape, [batch.seeds[r] for r in rows.tolist()], positions[rows].tolist()
        )
        tokens = tokens.index_copy(0, rows, (probs / noise).max(dim=-1).indices)
    asking = raw_logprobs[batch.wants_logprobs]
    width = int(batch.logprobs[batch.wants_logprobs].max()) if len(asking) else 0
    top = asking.topk(width, dim=-1)
    return Sampled(tokens, raw_logprobs.gather(1, tokens[:, None]).squeeze(1), top.indices, top.values)


def process(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The raw logits after repetition, presence and frequency penalties, logit bias, min_tokens and the
    constraint masks."""
    if not (len(batch.cu_history) or len(batch.bias_ids) or len(batch.suppress_ids) or batch.constrained):
        return logits
    # NOTE: a contiguous copy, as _penalize_ writes through a flat view.
    logits = logits.clone(memory_format=torch.contiguous_format)
    if len(batch.cu_history):
        _penalize_(logits, batch)
    if len(batch.bias_ids):
        logits.index_put_((batch.bias_rows, batch.bias_ids), batch.bias_values, accumulate=True)
    if len(batch.suppress_ids):
        rows = batch.suppress_rows
        pending = batch.output_lens[rows] < batch.min_tokens[rows]
        logits.index_put_((rows[pending], batch.suppress_ids[pending]), torch.tensor(float("-inf")))
    if batch.constrained:
        constraints.apply_(logits, batch.constraint_rows, batch.blocked)
    return logits


def _penalize_(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place, on the (row, token) entries the history holds only: dense [S, V] passes cost far more."""
    num_rows, vocab = logits.shape
    cu = batch.cu_history
    row_of = torch.repeat_interleave(torch.arange(num_rows), cu.diff())
    generated = torch.arange(len(batch.history)) - cu[row_of] >= batch.history_prompt_lens[row_of]
    entries, which = torch.unique(row_of * vocab + batch.history, return_inverse=True)
    counts = torch.zeros(len(entries)).index_add_(0, which[generated], torch.ones(int(generated.sum())))
    rows, flat = entries // vocab, logits.view(-1)
    values, penalty = flat[entries], batch.repetition_penalty[rows]
    values = torch.where(values > 0, values / penalty, values * penalty)
    flat[entries] = (
        values - batch.frequency_penalty[rows] * counts - batch.presence_penalty[rows] * (counts > 0)
    )


def _filter(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Sets logits outside each row's top-k, then its top-p nucleus, then below min_p times the most likely
    token's probability, to -inf."""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = torch.arange(vocab) >= k[:, None]
    probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
    # p / p_max >= min_p, in logits; log(0) = -inf keeps everything
    drop |= ordered < ordered[:, :1] + min_p.log()[:, None]
    return torch.empty_like(logits).scatter_(-1, order, ordered.masked_fill(drop, float("-inf")))


def _exponential_noise(shape: torch.Size, seeds: list[int | None], positions: list[int]) -> torch.Tensor:
    """Exp(1) noise: argmax(probs / noise) is a draw from probs. Seeded rows get their own generator."""
    noise = torch.empty(shape).exponential_()
    for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        if seed is not None:
            noise[row] = torch.empty(shape[-1]).exponential_(generator=_generator(seed, position))
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def _generator(seed: int, position: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))
