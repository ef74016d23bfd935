"""Block-sparse decode in the native kernels against the pure-torch reference: the blocks sparse_select.cpp
chooses are compute_service.attention.reference.sparse_blocks' (random pools and queries, float32, bfloat16
and half queries, per-row settings); a step mixing dense rows and rows of different settings gives each row
exactly what it gets alone, and the reference's attention; the native decode stack decodes block-sparse rows
as the Python layers do."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from common import paging
from common.kv_groups import group_layers
from common.sparse_settings import SparseAttention, SparseMode
from compute_service import kernels
from compute_service.attention.block_summaries import BlockSummaries
from compute_service.attention.reference import sparse_blocks
from compute_service.batch import ForwardBatch
from compute_service.model_loader import load
from compute_service.pool_layout import pool_layout
from compute_service.runner import Runner
from compute_service.validation import Limits
from protos import common_pb2, compute_pb2
from tests.architectures import BASE, draw_biases_and_head_norms
from tests.forward import forward_request
from tests.paged_pools import pool, tables
from tests.sparse_steps import BLOCK, HEAD_DIM, HEADS, KV_HEADS, native, reference, step
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the native kernels cannot be built here")

ROWS = [SparseAttention(1, 2, 3), None, SparseAttention(0, 1, 5), SparseAttention(2, 4, 1), None]


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(3)


def settings_of(rows: list[SparseAttention | None]) -> torch.Tensor:
    return torch.tensor([(s.sink, s.recent, s.topk) if s else (0, 1, 0) for s in rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.half])
def test_the_kernel_chooses_the_reference_blocks(dtype):
    context_lens = [37 * BLOCK + 3, 20 * BLOCK, 12 * BLOCK + 1, 50 * BLOCK, 6 * BLOCK]
    k_cache, _ = pool(BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    table = tables(context_lens, BLOCK)
    summaries = BlockSummaries([k_cache], (0,))
    summaries.refresh(table[table >= 0])
    query = torch.randn(len(context_lens), HEADS, HEAD_DIM).to(dtype)
    scale = HEAD_DIM**-0.5
    q_starts, lens = torch.arange(len(context_lens)), torch.tensor(context_lens)
    got_tables, got_lens = kernels.load().sparse_tables(
        query, summaries.of_layer(0), table, q_starts, lens, settings_of(ROWS), BLOCK, scale
    )
    for row, sparse in enumerate(ROWS):
        if sparse is None:
            assert torch.equal(got_tables[row], table[row]) and got_lens[row] == lens[row], "dense: as sent"
            continue
        keys = k_cache.view(-1, KV_HEADS, HEAD_DIM)[paging.slots(table[row], torch.arange(lens[row]), BLOCK)]
        chosen = sparse_blocks(sparse, query[row].float(), scale, keys, BLOCK, HEADS // KV_HEADS)
        assert got_tables[row, : len(chosen)].tolist() == table[row, chosen].tolist(), row
        assert (got_tables[row, len(chosen) :] == -1).all()
        last = int(lens[row]) - (paging.blocks_for(int(lens[row]), BLOCK) - 1) * BLOCK
        assert got_lens[row] == (len(chosen) - 1) * BLOCK + last


def test_bad_inputs_are_refused_by_the_kernel():
    k_cache, _ = pool(BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    bounds = BlockSummaries([k_cache], (0,)).of_layer(0)
    table, lens, starts = torch.zeros(2, 4, dtype=torch.long), torch.tensor([9, 9]), torch.arange(2)
    with pytest.raises(RuntimeError, match=r"settings \[N, 3\] must agree"):
        kernels.load().sparse_tables(torch.randn(2, HEADS, HEAD_DIM), bounds, table, starts, lens,
                                     torch.zeros(1, 3, dtype=torch.long), BLOCK, 1.0)  # fmt: skip
    with pytest.raises(RuntimeError, match="bounds must be contiguous float32"):
        kernels.load().sparse_tables(torch.randn(2, HEADS, HEAD_DIM), bounds.double(), table, starts, lens,
                                     torch.zeros(2, 3, dtype=torch.long), BLOCK, 1.0)  # fmt: skip


def test_a_mixed_step_gives_each_row_what_it_gets_alone():
    # decodes of different settings and dense ones, beside a prompt chunk
    q_lens = [1, 1, 1, 1, 1, 6]
    context_lens = [40 * BLOCK + 5, 33 * BLOCK, 30 * BLOCK + 2, 25 * BLOCK, 28 * BLOCK, 20 * BLOCK]
    rows = [*ROWS, SparseAttention(1, 1, 1)]
    inputs = step(q_lens, context_lens)
    k_cache, v_cache, table, cu, lens, slots, query = inputs
    mixed = native(*inputs, sparse=rows)
    torch.testing.assert_close(mixed, reference(*inputs[:5], query, sparse=rows), atol=2e-5, rtol=1e-4)
    for row, sparse in enumerate(rows):
        tokens = slice(int(cu[row]), int(cu[row + 1]))
        alone_cu = torch.tensor([0, q_lens[row]])
        alone = native(k_cache, v_cache, table[row : row + 1], alone_cu, lens[row : row + 1], slots[tokens],
                       query[tokens], sparse=[sparse])  # fmt: skip
        assert torch.equal(mixed[tokens], alone), row
        dense = native(k_cache, v_cache, table[row : row + 1], alone_cu, lens[row : row + 1], slots[tokens],
                       query[tokens])  # fmt: skip
        assert torch.equal(alone, dense) == (sparse is None or q_lens[row] > 1), row


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tiny = str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", initializer_range=0.3))
    model, spec = load(tiny, torch.float32, backend="cpu-native", sparse_attention=SparseMode(default=False))
    assert spec.plan.native_decode, "block-sparse decode runs in the native stack"
    return model, spec


def test_the_native_stack_decodes_sparse_rows_as_the_python_layers(model):
    model, spec = model
    config, num_blocks = model.config, 96
    runner = Runner(model, plan=spec.plan)
    shape = (config.num_hidden_layers, 2, num_blocks, BLOCK, config.num_key_value_heads, config.head_dim)
    runner.attach(torch.randn(shape) * 0.5)
    limits = Limits(
        config.vocab_size, config.max_position_embeddings, num_blocks, BLOCK, spec.plan.sparse_attention
    )
    blocks = torch.randperm(num_blocks).tolist()
    cached = [20 * BLOCK + 3, 18 * BLOCK, 11 * BLOCK, 15 * BLOCK + 7]
    tables_ = [blocks[i * 24 : (i + 1) * 24] for i in range(len(cached))]
    request = forward_request([[5], [9], [11], [13]], cached, tables_, block_size=BLOCK)
    request.sparse.extend(
        compute_pb2.SparseRow(sink=s.sink, recent=s.recent, topk=s.topk) if s else compute_pb2.SparseRow()
        for s in ROWS[:4]
    )
    batch = ForwardBatch.from_request(request, limits)
    stack = model.model.native_decode
    try:
        native_logits = runner.logits(batch)
        model.model.native_decode = None
        python_logits = runner.logits(batch)
    finally:
        model.model.native_decode = stack
    torch.testing.assert_close(native_logits, python_logits, atol=1e-4, rtol=1e-4)
    request.ClearField("sparse")  # rows that say nothing: dense under allow
    dense_logits = runner.logits(ForwardBatch.from_request(request, limits))
    differs = [not torch.allclose(native_logits[r], dense_logits[r], atol=1e-5) for r in range(4)]
    assert differs == [True, False, True, True], "rows 0, 2 and 3 select; row 1 is dense"


def test_sparse_rows_over_kv_groups_decode_as_over_one_table(tmp_path):
    # Qwen2 with two full layers and a sliding one: three KV groups of one layer, two of them selecting
    torch.manual_seed(0)
    config = Qwen2Config(
        **{**BASE, "num_hidden_layers": 3},
        use_sliding_window=True,
        sliding_window=11,
        max_window_layers=2,
    )
    hf_model = AutoModelForCausalLM.from_config(config)
    draw_biases_and_head_norms(hf_model)
    hf_model.save_pretrained(tmp_path / "qwen2")
    model, spec = load(
        str(tmp_path / "qwen2"), torch.float32, backend="cpu-native", sparse_attention=SparseMode()
    )
    windows = spec.sliding_windows
    groups = group_layers(windows)
    assert spec.plan.native_decode and windows == (0, 0, 11) and len(groups) == 3
    num_blocks, null, width = 13 * 24, 0, 24
    shape = (3, 2, num_blocks, BLOCK, config.num_key_value_heads, config.head_dim)
    single, grouped = Runner(model, plan=spec.plan), Runner(model, plan=spec.plan)
    one_pool, group_pool = torch.randn(shape) * 0.5, torch.zeros(1, *shape[1:])
    single.attach(one_pool)
    layouts = [common_pb2.KVGroupLayout(layers=group.layers, window=group.window) for group in groups]
    handle = common_pb2.PoolHandle(shape=list(group_pool.shape), kv_groups=layouts)
    grouped.attach(group_pool, pool_layout(handle, windows))
    # each group's blocks hold what the single table's hold for its layer, under ids of its own; a sliding
    # table's entries before the window name the null block
    cached = [20 * BLOCK + 3, 18 * BLOCK, 11 * BLOCK, 15 * BLOCK + 7]
    one = torch.randperm(num_blocks).view(-1, width)[: len(cached)].tolist()
    ids = (torch.randperm(num_blocks - 1) + 1)[: len(groups) * len(cached) * width].view(
        len(groups), -1, width
    )
    tables = ids.tolist()
    for group, group_tables in zip(groups, tables, strict=True):
        (layer,) = group.layers
        for row, n in enumerate(cached):
            kept = group.first_kept(n, BLOCK)
            group_tables[row][:kept] = [null] * kept
            for b in range(kept, -(-n // BLOCK)):
                group_pool[0, :, group_tables[row][b]] = one_pool[layer, :, one[row][b]]
    new = [[5], [9], [11], [13]]
    sparse = [compute_pb2.SparseRow(sink=s.sink, recent=s.recent, topk=s.topk) for s in ROWS if s][:3]
    sparse.append(compute_pb2.SparseRow())
    request = forward_request(new, cached, one, block_size=BLOCK)
    request.sparse.extend(sparse)
    in_groups = forward_request(new, cached, tables[0], block_size=BLOCK)
    for group_tables in tables[1:]:
        in_groups.block_tables.extend(
            forward_request(new, cached, group_tables, block_size=BLOCK).block_tables
        )
    in_groups.num_kv_groups = len(groups)
    in_groups.sparse.extend(sparse)
    limits = Limits(config.vocab_size, 512, num_blocks, BLOCK, spec.plan.sparse_attention)
    grouped_limits = Limits(
        config.vocab_size, 512, num_blocks, BLOCK, spec.plan.sparse_attention, len(groups)
    )
    stack = model.model.native_decode
    for decoder in (stack, None):
        model.model.native_decode = decoder
        try:
            expected = single.logits(ForwardBatch.from_request(request, limits))
            got = grouped.logits(ForwardBatch.from_request(in_groups, grouped_limits))
        finally:
            model.model.native_decode = stack
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    request.ClearField("sparse")
    dense = single.logits(ForwardBatch.from_request(request, limits))
    assert not torch.allclose(dense[0], expected[0], atol=1e-5), "row 0 selects: not the dense logits"
