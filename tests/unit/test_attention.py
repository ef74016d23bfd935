"""The CPU paged attention backends (cpu, cpu-native) against the dense reference and plain dense attention
of the full sequences: full layers, sliding windows and soft-capped scores."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from compute_service.architectures import FULL, LayerAttention
from compute_service.attention import cpu, cpu_native
from compute_service.attention.context import build_context, reset_context, set_context
from compute_service.attention.reference import reference_attention
from compute_service.batch import ForwardBatch
from compute_service.validation import Limits
from tests.forward import forward_request

BLOCK_SIZE, NUM_BLOCKS, HEADS, KV_HEADS, HEAD_DIM = 4, 64, 6, 2, 8
SCALE = HEAD_DIM**-0.5
LIMITS = Limits(
    vocab_size=1, max_model_len=NUM_BLOCKS * BLOCK_SIZE, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE
)


class Sequence:
    """Full random q/k/v of a sequence, the shuffled blocks it owns, and how many tokens are in the pool."""

    def __init__(self, length: int, blocks: list[int], dtype: torch.dtype) -> None:
        self.q = torch.randn(length, HEADS, HEAD_DIM, dtype=dtype)
        self.k = torch.randn(length, KV_HEADS, HEAD_DIM, dtype=dtype)
        self.v = torch.randn(length, KV_HEADS, HEAD_DIM, dtype=dtype)
        self.blocks = blocks
        self.cached = 0

    def slots(self, positions: range) -> list[int]:
        return [self.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


BACKEND = {"attend": cpu.paged_attention}


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, params=["cpu", "cpu-native"])
def backend(request, monkeypatch):
    """Every test runs against each CPU backend."""
    attend = {"cpu": cpu.paged_attention, "cpu-native": cpu_native.paged_attention}[request.param]
    monkeypatch.setitem(BACKEND, "attend", attend)


def make(lengths: list[int], dtype: torch.dtype = torch.float32):
    """Sequences over a shuffled block allocation, and a pool full of finite garbage."""
    order = torch.randperm(NUM_BLOCKS).tolist()
    seqs = []
    for length in lengths:
        count = -(-length // BLOCK_SIZE)
        seqs.append(Sequence(length, order[:count], dtype))
        order = order[count:]
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return seqs, torch.randn(shape).mul(50).to(dtype), torch.randn(shape).mul(50).to(dtype)


def batch(new: list[int], cached: list[int], tables: list[list[int]]) -> ForwardBatch:
    """The checked batch of `new[i]` tokens after `cached[i]` per sequence (token ids do not matter here)."""
    request = forward_request([[0] * n for n in new], cached, tables, block_size=BLOCK_SIZE)
    return ForwardBatch.from_request(request, LIMITS)


def step(
    seqs: list[Sequence],
    new: list[int],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attends: LayerAttention = FULL,
) -> torch.Tensor:
    """Runs one packed step of `new[i]` tokens per sequence through the backend, for a layer that attends as
    `attends` says; checks it on the way."""
    spans = [range(s.cached, s.cached + n) for s, n in zip(seqs, new, strict=True)]
    q = torch.cat([s.q[span] for s, span in zip(seqs, spans, strict=True)])
    k = torch.cat([s.k[span] for s, span in zip(seqs, spans, strict=True)])
    v = torch.cat([s.v[span] for s, span in zip(seqs, spans, strict=True)])
    slots = torch.tensor([slot for s, span in zip(seqs, spans, strict=True) for slot in s.slots(span)])
    forward = batch(new, [s.cached for s in seqs], [s.blocks for s in seqs])
    assert torch.equal(forward.slot_mapping, slots)

    set_context(build_context([k_cache], [v_cache], forward, layers=(attends,)))
    try:
        out = BACKEND["attend"](
            SimpleNamespace(layer_idx=0),
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            None,
            scaling=SCALE,
            sliding_window=attends.window or None,
            softcap=attends.softcap or None,
        )[0]
    finally:
        reset_context()
    assert out.shape == (1, len(q), HEADS, HEAD_DIM)
    out = out[0]

    # the new K/V landed at their slots
    flat_k = k_cache.view(-1, KV_HEADS, HEAD_DIM)
    flat_v = v_cache.view(-1, KV_HEADS, HEAD_DIM)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)

    tol = dict(atol=1e-5, rtol=1e-4) if q.dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    reference = reference_attention(
        q, k_cache, v_cache, forward.cu_seqlens_q, forward.context_lens, forward.block_tables, SCALE,
        attends.window, attends.softcap,
    )  # fmt: skip
    torch.testing.assert_close(out, reference, **tol)
    torch.testing.assert_close(out, dense(seqs, spans, attends), **tol)
    for s, n in zip(seqs, new, strict=True):
        s.cached += n
    return out


def dense(seqs: list[Sequence], spans: list[range], attends: LayerAttention = FULL) -> torch.Tensor:
    """Causal attention over each whole sequence so far, rows of the new tokens only: SDPA with its mask
    (causal, within the window), scores soft-capped by hand as transformers' eager attention does."""
    rows = []
    for s, span in zip(seqs, spans, strict=True):
        q, k, v = (t[: span.stop].transpose(0, 1)[None].float() for t in (s.q, s.k, s.v))
        positions = torch.arange(span.stop)
        mask = positions[None, :] <= positions[:, None]
        if attends.window:
            mask &= positions[None, :] > positions[:, None] - attends.window
        if attends.softcap:
            k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
            scores = torch.tanh(q @ k.transpose(2, 3) * SCALE / attends.softcap) * attends.softcap
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
        rows.append(o[0].transpose(0, 1)[span.start :])
    return torch.cat(rows).to(seqs[0].q.dtype)


def test_prefill_packed_sequences_with_partial_blocks():
    seqs, k_cache, v_cache = make([5, 8, 2, 13])
    step(seqs, [5, 8, 2, 13], k_cache, v_cache)


def test_prefill_on_top_of_cached_blocks():
    seqs, k_cache, v_cache = make([9, 13, 5, 13])
    step(seqs, [4, 6, 3, 9], k_cache, v_cache)
    step(seqs, [5, 7, 2, 4], k_cache, v_cache)


def test_batched_decode():
    seqs, k_cache, v_cache = make([8, 11, 4, 15])
    step(seqs, [5, 8, 1, 12], k_cache, v_cache)
    for _ in range(3):
        step(seqs, [1, 1, 1, 1], k_cache, v_cache)


def test_mixed_step_of_decodes_chunks_and_fresh_prompts():
    seqs, k_cache, v_cache = make([8, 12, 6, 1, 9])
    step(seqs[:2], [6, 3], k_cache, v_cache)
    step(seqs, [1, 9, 6, 1, 2], k_cache, v_cache)
    step(seqs[::4], [1, 7], k_cache, v_cache)


def test_bfloat16_within_tolerance():
    seqs, k_cache, v_cache = make([7, 11, 4], dtype=torch.bfloat16)
    step(seqs, [6, 5, 3], k_cache, v_cache)
    step(seqs, [1, 6, 1], k_cache, v_cache)


def test_decode_groups_split_to_bound_each_gather(monkeypatch):
    monkeypatch.setattr(cpu, "GATHER_KEYS", 20)
    seqs, k_cache, v_cache = make([9, 9, 9, 9, 9, 4])
    step(seqs, [8, 8, 8, 8, 8, 3], k_cache, v_cache)
    groups = cpu.step_groups(
        build_context([k_cache], [v_cache], batch([1] * 5, [8] * 5, [s.blocks for s in seqs[:5]]))
    ).decode_groups
    assert [(g.first, g.count) for g in groups] == [(0, 2), (2, 2), (4, 1)], "at most 20 // 9 per gather"
    step(seqs, [1, 1, 1, 1, 1, 1], k_cache, v_cache)


# windows of one key, under a block, over one and several blocks; caps that bind and that barely do
PATTERNS = [LayerAttention(1), LayerAttention(3), LayerAttention(6), LayerAttention(9),
            LayerAttention(0, 2.0), LayerAttention(5, 1.5), LayerAttention(7, 30.0)]  # fmt: skip


@pytest.mark.parametrize("attends", PATTERNS, ids=lambda a: f"window{a.window}-softcap{a.softcap}")
def test_sliding_windows_and_softcaps_in_prompts_chunks_and_decodes(attends):
    seqs, k_cache, v_cache = make([21, 14, 6, 3, 17])
    step(seqs, [13, 9, 6, 2, 1], k_cache, v_cache, attends)
    a, b, _, d, e = seqs
    step([a, b, d, e], [1, 5, 1, 11], k_cache, v_cache, attends)
    for _ in range(3):
        step([a, e], [1, 1], k_cache, v_cache, attends)
    step([a, e], [4, 1], k_cache, v_cache, attends)


def test_a_window_in_bfloat16_within_tolerance():
    seqs, k_cache, v_cache = make([19, 12], dtype=torch.bfloat16)
    step(seqs, [11, 12], k_cache, v_cache, LayerAttention(5, 4.0))
    step(seqs[:1], [8], k_cache, v_cache, LayerAttention(5, 4.0))
