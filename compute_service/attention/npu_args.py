"""The NPU backend's per-step arguments for torch_npu's paged attention ops, built without torch_npu, and
pure-torch implementations of those ops' documented semantics, by which the arguments are checked on the
CPU (they must reproduce the cpu backend on the same batch):

- `npu_fused_infer_attention_score(query, key_cache, value_cache, num_heads, num_key_value_heads,
  input_layout="TND", scale, block_table, block_size, actual_seq_lengths, actual_seq_lengths_kv,
  sparse_mode=3, atten_mask)`: query packed as TND [T, N, D]; caches [blocks, block_size, KV_N * D];
  `block_table` int32 [B, W]; `actual_seq_lengths` the cumulative query ends (TND); `actual_seq_lengths_kv`
  each sequence's key count; sparse_mode 3 (rightDownCausal) with the 2048 x 2048 upper-triangular mask, or
  for a sliding-window layer sparse_mode 4 (band) with pre_tokens = window - 1 (the keys before a query's
  own that it sees) and next_tokens = 0, the band aligned to the bottom right as mode 3's diagonal is. The op
  has no logit soft-capping: a soft-capped model is refused on this backend (registry.require_attention).
- `_npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)`: K/V [T, KV_N, D] written to
  caches [blocks, block_size, KV_N, D] at int32 slots.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Prefill chunks need pages of a multiple of 128 tokens; decode-only steps a multiple of 16.
PREFILL_BLOCK_MULTIPLE = 128
DECODE_BLOCK_MULTIPLE = 16
# sparse_mode 3 takes this fixed causal mask (True: masked) whatever the sequence lengths.
MASK_SIZE = 2048
RIGHT_DOWN_CAUSAL = 3
BAND = 4


@dataclass(frozen=True)
class FiasArgs:
    """npu_fused_infer_attention_score's keyword arguments for a step, and the write's slots."""

    num_heads: int
    num_key_value_heads: int
    scale: float
    block_size: int
    block_table: torch.Tensor  # int32 [B, W], padding 0 (never read: past each sequence's keys)
    actual_seq_lengths: list[int]  # cumulative query ends, B of them (TND)
    actual_seq_lengths_kv: list[int]  # keys per sequence (cached + new)
    atten_mask: torch.Tensor  # bool [MASK_SIZE, MASK_SIZE], True above the diagonal
    slot_mapping: torch.Tensor  # int32 [T]
    input_layout: str = "TND"
    sparse_mode: int = RIGHT_DOWN_CAUSAL

    def attention_kwargs(self, window: int = 0) -> dict:
        """The keywords of npu_fused_infer_attention_score (all but query, key and value) for a layer of this
        sliding window (0: full attention)."""
        band = {"sparse_mode": BAND, "pre_tokens": window - 1, "next_tokens": 0} if window else {}
        return {
            "num_heads": self.num_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "input_layout": self.input_layout,
            "scale": self.scale,
            "block_table": self.block_table,
            "block_size": self.block_size,
            "actual_seq_lengths": self.actual_seq_lengths,
            "actual_seq_lengths_kv": self.actual_seq_lengths_kv,
            "sparse_mode": self.sparse_mode,
            "atten_mask": self.atten_mask,
            **band,
        }


def build_fias_args(
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    heads: tuple[int, int],
    block_size: int,
    scale: float,
    device: torch.device | str = "cpu",
) -> FiasArgs:
    """The arguments for a checked step (compute_service/batch.py) of `heads` (query heads, KV heads).
    ValueError for a block size the op cannot page by."""
    assert len(cu_seqlens_q) == len(context_lens) + 1 == len(block_tables) + 1
    require_block_size(block_size, prefill=bool((cu_seqlens_q.diff() > 1).any()))
    return FiasArgs(
        num_heads=heads[0],
        num_key_value_heads=heads[1],
        scale=scale,
        block_size=block_size,
        block_table=block_tables.clamp(min=0).to(device, torch.int32),
        actual_seq_lengths=cu_seqlens_q[1:].tolist(),
        actual_seq_lengths_kv=context_lens.tolist(),
        atten_mask=torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu(1),
        slot_mapping=slot_mapping.to(device, torch.int32),
    )


def require_block_size(block_size: int, prefill: bool = True) -> None:
    """ValueError unless the op pages by `block_size`: a multiple of 128 when a step holds prefill
    chunks (any pool gets them), of 16 for decodes."""
    multiple = PREFILL_BLOCK_MULTIPLE if prefill else DECODE_BLOCK_MULTIPLE
    if block_size % multiple:
        raise ValueError(
            f"the npu attention backend pages K/V by blocks of a multiple of {multiple} tokens, the pool's "
            f"are {block_size}: start the gateway with --block-size {PREFILL_BLOCK_MULTIPLE}"
        )


def fused_infer_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs
) -> torch.Tensor:
    """npu_fused_infer_attention_score's attention output for TND paged inputs (float32 math): query
    [T, N, D]; key/value [blocks, block_size, KV_N * D]. Sequence b's queries end at
    actual_seq_lengths[b] (cumulative), its keys are the first actual_seq_lengths_kv[b] tokens of the
    blocks block_table[b]; sparse_mode 3 masks what atten_mask masks, aligned to the bottom right; sparse_mode
    4 keeps the keys from pre_tokens before a query's diagonal to next_tokens after it, the same diagonal."""
    assert kwargs["input_layout"] == "TND" and kwargs["sparse_mode"] in (RIGHT_DOWN_CAUSAL, BAND)
    table, mask = kwargs["block_table"], kwargs["atten_mask"]
    assert table.dtype == torch.int32 and mask.dtype == torch.bool, (table.dtype, mask.dtype)
    n, kv_n, block_size = kwargs["num_heads"], kwargs["num_key_value_heads"], kwargs["block_size"]
    ends, head_dim = kwargs["actual_seq_lengths"], query.shape[-1]
    if sorted(ends) != list(ends) or ends[-1] != len(query):
        raise ValueError(f"TND actual_seq_lengths are cumulative query ends up to {len(query)}, got {ends}")
    assert key.shape[1] == block_size and key.shape[2] == kv_n * head_dim, key.shape
    out, start = torch.empty_like(query), 0
    for b, (end, kv_len) in enumerate(
        zip(kwargs["actual_seq_lengths"], kwargs["actual_seq_lengths_kv"], strict=True)
    ):
        pages = table[b, : -(-kv_len // block_size)].long()
        k = key[pages].reshape(-1, kv_n, head_dim)[:kv_len].float().repeat_interleave(n // kv_n, dim=1)
        v = value[pages].reshape(-1, kv_n, head_dim)[:kv_len].float().repeat_interleave(n // kv_n, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * kwargs["scale"]
        # NOTE: the mask's entry (r, c) depends on c - r only; key k's diagonal offset from query j,
        # aligned to the bottom right, picks it whatever the lengths (also beyond MASK_SIZE).
        diagonal = torch.arange(kv_len)[None, :] - torch.arange(end - start)[:, None] - (kv_len - end + start)
        if kwargs["sparse_mode"] == BAND:
            masked = (diagonal > kwargs["next_tokens"]) | (diagonal < -kwargs["pre_tokens"])
        else:
            masked = mask[(-diagonal).clamp(0, MASK_SIZE - 1), diagonal.clamp(0, MASK_SIZE - 1)]
        scores = scores.masked_fill(masked, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", F.softmax(scores, -1), v).to(query.dtype)
        start = end
    return out


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """_npu_reshape_and_cache: K/V [T, KV_N, D] to caches [blocks, block_size, KV_N, D] at int32 slots."""
    assert slot_indices.dtype == torch.int32, slot_indices.dtype
    for src, cache in ((key, key_cache), (value, value_cache)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_indices.long(), src.to(cache.dtype))
