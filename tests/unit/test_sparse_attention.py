"""Block-sparse decode (compute_service.attention.sparse) in the cpu-native backend against the dense
reference's sparse mode, float32: exactly dense when the budget covers every table, the reference's choice
of blocks otherwise (GQA, soft-capped and sliding-window layers, prompts in the same step), block summaries
rebuilt from the pool when they may be stale; the flag's parsing and the plan's refusals."""

import pytest
import torch

from common.sparse_settings import SparseAttention, SparseMode, parse
from compute_service.architectures import FULL, LayerAttention
from compute_service.attention.block_summaries import BlockSummaries
from tests.sparse_steps import BLOCK, HEAD_DIM, KV_HEADS, SPARSE, native, reference, run_native, step


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.mark.parametrize("budget_blocks", [3, 6, 20])
def test_a_budget_covering_every_table_is_exactly_dense(budget_blocks):
    # tables of up to `budget_blocks` blocks, decodes and a prompt chunk over a cached prefix
    q_lens = [1, 1, 1, 5]
    context_lens = [budget_blocks * BLOCK, budget_blocks * BLOCK - 3, 17, budget_blocks * BLOCK]
    inputs = step(q_lens, context_lens)
    covering = SparseAttention(sink=1, recent=1, topk=budget_blocks - 2)
    dense = native(*inputs)
    assert torch.equal(native(*inputs, sparse=covering), dense)
    torch.testing.assert_close(dense, reference(*inputs[:5], inputs[6]), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_sparse_decodes_match_the_reference_choice(softcap):
    # long decodes that select, one at the budget (dense), one short, a prompt chunk, two sharing a prefix
    q_lens = [1, 1, 1, 1, 7, 1]
    context_lens = [40 * BLOCK + 5, 6 * BLOCK, 6 * BLOCK + 1, 3, 20 * BLOCK, 33 * BLOCK]
    inputs = step(q_lens, context_lens)
    attends = LayerAttention(0, softcap)
    out = native(*inputs, sparse=SPARSE, attends=attends)
    expected = reference(*inputs[:5], inputs[6], sparse=SPARSE, attends=attends)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    dense = reference(*inputs[:5], inputs[6], attends=attends)
    selecting = [0, 2, 5]  # decodes of more than the budget's 6 blocks
    for row in range(len(q_lens)):
        rows = slice(int(inputs[3][row]), int(inputs[3][row + 1]))
        differs = not torch.allclose(out[rows], dense[rows], atol=1e-4)
        assert differs == (row in selecting), row


def test_shared_prefixes_and_gqa_shapes_match_the_reference():
    inputs = step([1] * 6, [30 * BLOCK + i for i in range(6)], shared=12)
    torch.testing.assert_close(
        native(*inputs, sparse=SPARSE), reference(*inputs[:5], inputs[6], sparse=SPARSE), atol=2e-5, rtol=1e-4
    )


def test_a_sliding_window_layer_stays_dense():
    inputs = step([1, 1], [30 * BLOCK, 9 * BLOCK + 4])
    window = LayerAttention(5 * BLOCK, 0.0)
    out = native(*inputs, sparse=SPARSE, attends=window)
    assert torch.equal(out, native(*inputs, attends=window))
    torch.testing.assert_close(out, reference(*inputs[:5], inputs[6], attends=window), atol=2e-5, rtol=1e-4)


def test_summaries_are_rebuilt_from_the_pool_once_no_longer_current():
    k_cache, v_cache, table, cu, context_lens, slots, query = step([1], [30 * BLOCK])
    summaries = BlockSummaries([k_cache], (0,))
    args = (k_cache, v_cache, table, cu, context_lens, slots, query, SPARSE, summaries, FULL)
    run_native(*args)
    assert summaries.current[table[0, SPARSE.sink : 30 - SPARSE.recent]].all()
    # the cache fills block 10 anew (a restored tier block, say) and the step says the prefix was cached
    k_cache[table[0, 10]] = torch.randn(BLOCK, KV_HEADS, HEAD_DIM) * 3
    summaries.forget(table[0, :29])
    out = run_native(*args)
    expected = reference(k_cache, v_cache, table, cu, context_lens, query, sparse=SPARSE)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    lows, highs = summaries.of(0, table[0, 10])
    assert torch.equal(lows, k_cache[table[0, 10]].amin(0)) and torch.equal(
        highs, k_cache[table[0, 10]].amax(0)
    )


def test_written_blocks_are_no_longer_current():
    k_cache, *_ = step([1], [4])
    summaries = BlockSummaries([k_cache], (0,))
    summaries.current[:] = True
    summaries.written(torch.tensor([3 * BLOCK + 2, 7 * BLOCK]))
    assert (~summaries.current).nonzero().squeeze(1).tolist() == [3, 7]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("off", None),
        ("", None),
        ("on", SparseMode()),
        ("allow", SparseMode(default=False)),
        ("topk=16", SparseMode(SparseAttention(topk=16))),
        ("on,topk=16", SparseMode(SparseAttention(topk=16))),
        ("allow,sink=0,recent=2,topk=4", SparseMode(SparseAttention(0, 2, 4), default=False)),
        ("sink=0,recent=2,topk=4", SparseMode(SparseAttention(0, 2, 4))),
    ],
)
def test_the_flag_parses(text, expected):
    assert parse(text) == expected
    assert expected is None or parse(str(expected)) == expected, "forwarded by `up` as str()"


@pytest.mark.parametrize(
    "text", ["sink=1,sink=2", "window=4", "topk=-1", "topk=0", "recent=0", "topk", "allow,on", "topk=2,allow"]
)
def test_a_bad_flag_says_what_is_accepted(text):
    with pytest.raises(ValueError, match="--sparse-attention"):
        parse(text)
