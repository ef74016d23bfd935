"""Sampling over the packed batch: greedy, temperature, top-k and top-p from one sort, per-row seeds."""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protos import common_pb2


@dataclass(slots=True)
class SamplingBatch:
    """One row per sequence that samples this step."""

    temperature: torch.Tensor  # [S] float32; 0 is greedy
    top_p: torch.Tensor  # [S] float32; 1 is off
    top_k: torch.Tensor  # [S] int64; 0 is off
    seeds: list[int | None]

    @classmethod
    def from_params(cls, params: Sequence[common_pb2.SamplingParams]) -> "SamplingBatch":
        return cls(
            temperature=torch.tensor(
                [p.temperature if p.HasField("temperature") else 1.0 for p in params], dtype=torch.float32
            ),
            top_p=torch.tensor(
                [p.top_p if p.HasField("top_p") else 1.0 for p in params], dtype=torch.float32
            ),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            seeds=[p.seed if p.HasField("seed") else None for p in params],
        )


def sample(
    logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] float32 -> (token [S], its log-probability under the unscaled logits [S]).

    `positions` [S] are the positions the sampled tokens will take; a seeded row draws from a generator
    derived from (seed, position) alone, so it samples the same token whatever else is in the batch.
    """
    assert logits.dim() == 2 and len(logits) == len(batch.temperature) == len(positions) == len(batch.seeds)
    tokens = logits.argmax(dim=-1)
    rows = (batch.temperature > 0).nonzero().squeeze(1)
    if len(rows):
        scaled = logits[rows] / batch.temperature[rows, None]
        probs = _filter(scaled, batch.top_k[rows], batch.top_p[rows]).softmax(dim=-1)
        noise = _exponential_noise(
            probs.shape, [batch.seeds[r] for r in rows.tolist()], positions[rows].tolist()
        )
        tokens = tokens.index_copy(0, rows, (probs / noise).argmax(dim=-1))
    logprobs = logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = torch.arange(vocab) >= k[:, None]
    probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
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
