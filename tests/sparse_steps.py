"""A step of random paged K/V for block-sparse decode's tests: cpu-native's attention function with and
without block-sparse rows, and the dense reference's."""

from types import SimpleNamespace

import torch

from common import paging
from common.sparse_settings import SparseAttention
from compute_service.architectures import FULL
from compute_service.attention import cpu_native
from compute_service.attention.block_summaries import BlockSummaries
from compute_service.attention.context import Context, reset_context, set_context
from compute_service.attention.reference import reference_attention
from compute_service.attention.sparse import SparseDecode
from tests.paged_pools import pool, tables

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SPARSE = SparseAttention(sink=1, recent=2, topk=3)


def step(q_lens: list[int], context_lens: list[int], shared: int = 0):
    """A step's pool (K, V), tables, cu_seqlens_q, context lengths, slots and queries [T, H, D]."""
    k_cache, v_cache = pool(BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    table = tables(context_lens, BLOCK, shared)
    cu = torch.tensor([0, *q_lens]).cumsum(0)
    positions = torch.cat([torch.arange(n - q, n) for q, n in zip(q_lens, context_lens, strict=True)])
    rows = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = paging.slots(table.view(-1), rows * table.shape[1] * BLOCK + positions, BLOCK)
    query = torch.randn(int(cu[-1]), HEADS, HEAD_DIM)
    return k_cache, v_cache, table, cu, torch.tensor(context_lens), slots, query


def native(k_cache, v_cache, table, cu, context_lens, slots, query, sparse=None, attends=FULL):
    """cpu-native's attention function on layer 0, the new tokens' K/V those already in the pool; `sparse`
    for every row, or a list of one per row."""
    summaries = None if sparse is None else BlockSummaries([k_cache], (0,))
    return run_native(k_cache, v_cache, table, cu, context_lens, slots, query, sparse, summaries, attends)


def run_native(k_cache, v_cache, table, cu, context_lens, slots, query, sparse, summaries, attends):
    prompts = (cu.diff() > 1).nonzero().squeeze(1).tolist()
    rows = sparse if isinstance(sparse, list) else [sparse] * len(context_lens)
    decode = None if sparse is None else SparseDecode(rows, summaries)
    if summaries is not None:
        summaries.written(slots)
    ctx = Context(
        [k_cache], [v_cache], slots, cu, context_lens, table, prompts, layers=(attends,), sparse=decode
    )
    flat_k, flat_v = (cache.view(-1, KV_HEADS, HEAD_DIM)[slots] for cache in (k_cache, v_cache))
    set_context(ctx)
    try:
        out, _ = cpu_native.paged_attention(
            SimpleNamespace(layer_idx=0),
            query.transpose(0, 1)[None],
            flat_k.transpose(0, 1)[None],
            flat_v.transpose(0, 1)[None],
            None,
            scaling=HEAD_DIM**-0.5,
            sliding_window=attends.window or None,
            softcap=attends.softcap or None,
        )
    finally:
        reset_context()
    return out[0]


def reference(k_cache, v_cache, table, cu, context_lens, query, sparse=None, attends=FULL):
    return reference_attention(
        query,
        k_cache,
        v_cache,
        cu,
        context_lens,
        table,
        HEAD_DIM**-0.5,
        attends.window,
        attends.softcap,
        sparse,
    )
