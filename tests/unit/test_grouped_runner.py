"""A pool of several KV groups read by compute: a tiny random Gemma 2 (a sliding and a full layer, two groups
of one layer over one layer slot) gives transformers' logits through each attention backend that runs on the
cpu (cuda's by its torch path), its sliding table's entries before the window naming a null block of
garbage, as the cache's released ones do; and the layouts compute refuses."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.errors import InvalidArgument
from compute_service import kernels
from compute_service.batch import ForwardBatch
from compute_service.model_loader import register_attention
from compute_service.pool_layout import pool_layout
from compute_service.runner import Runner
from compute_service.validation import Limits
from protos import common_pb2
from tests.architectures import SLIDING_WINDOWS, tiny_config
from tests.forward import forward_request

BS, NUM_BLOCKS, NULL = 4, 64, 0
WINDOWS = SLIDING_WINDOWS["gemma2"]  # (10, 0): layer 0 slides, layer 1 attends to every key
PROMPTS = [[7, 3, 99, 4, 18, 21, 5, 66, 71, 2, 9, 13, 200, 31, 8, 44, 17, 23, 4, 6, 90, 101, 33], [5, 6, 7]]
BACKENDS = ["cpu", "cuda"] + (["cpu-native"] if kernels.load() is not None else [])


def handle(groups: list[tuple[list[int], int]], slots: int = 1) -> common_pb2.PoolHandle:
    layouts = [common_pb2.KVGroupLayout(layers=layers, window=window) for layers, window in groups]
    return common_pb2.PoolHandle(shape=[slots, 2, NUM_BLOCKS, BS, 1, 8], kv_groups=layouts)


GROUPED = handle([([1], 0), ([0], WINDOWS[0])])


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    config = tiny_config("gemma2")
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def paged_model(reference, backend: str):
    config = tiny_config("gemma2")
    paged = AutoModelForCausalLM.from_config(
        config, attn_implementation=register_attention(backend), dtype=torch.float32
    ).eval()
    paged.load_state_dict(reference.state_dict())
    return paged


def grouped_request(new, cached, tables: list[list[list[int]]]):
    """One step whose sequences hold tables[g][i] in KV group g; group 1 (the sliding one) names NULL for
    the blocks wholly before the window of the sequence's first new token, as the cache releases them."""
    sliding = [
        [NULL if b < max(0, c - WINDOWS[0] + 1) // BS else block for b, block in enumerate(table)]
        for table, c in zip(tables[1], cached, strict=True)
    ]
    parts = [forward_request(new, cached, group, block_size=BS) for group in (tables[0], sliding)]
    request = parts[0]
    assert parts[1].block_table_width == request.block_table_width
    request.block_tables.extend(parts[1].block_tables)
    request.num_kv_groups = 2
    return request


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grouped_pool_gives_transformers_logits_through_chunks_and_decodes(reference, backend):
    config = reference.config
    runner = Runner(paged_model(reference, backend))
    layout = pool_layout(GROUPED, WINDOWS)
    assert (layout.slots, layout.groups, layout.num_groups) == ((0, 0), (1, 0), 2)
    pool = torch.randn(1, 2, NUM_BLOCKS, BS, config.num_key_value_heads, config.head_dim)
    runner.attach(pool, layout)
    # distinct blocks per group and sequence, none of them the null block
    order = (torch.randperm(NUM_BLOCKS - 1) + 1).tolist()
    per_seq = -(-(max(map(len, PROMPTS)) + 8) // BS)
    tables = [[order[(2 * i + g) * per_seq : (2 * i + g + 1) * per_seq] for i in range(2)] for g in range(2)]
    limits = Limits(config.vocab_size, config.max_position_embeddings, NUM_BLOCKS, BS, num_groups=2)
    long, short = PROMPTS
    first = [group[:1] for group in tables]
    steps = [([long[:13], short], [0, 0], tables), ([long[13:]], [13], first)]
    logits = [runner.logits(ForwardBatch.from_request(grouped_request(*step), limits)) for step in steps]
    generated = [int(logits[0][1].argmax()), int(logits[1][0].argmax())]
    sequences = [short + [generated[0]], long + [generated[1]]]
    # decodes of both, packed, their windows sliding past released blocks
    for _ in range(6):
        new = [[seq[-1]] for seq in sequences]
        cached = [len(seq) - 1 for seq in sequences]
        step = ForwardBatch.from_request(
            grouped_request(new, cached, [tables[0][::-1], tables[1][::-1]]), limits
        )
        out = runner.logits(step)
        for seq, row in zip(sequences, out, strict=True):
            with torch.inference_mode():
                expected = reference(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(row, expected, atol=1e-4, rtol=1e-4)
            seq.append(int(row.argmax()))
    with torch.inference_mode():
        assert int(reference(torch.tensor([short])).logits[0, -1].argmax()) == generated[0]
    assert len(set(sequences[1][len(long) :])) > 1, "a degenerate model would not test attention"


@pytest.mark.parametrize(
    ("groups", "slots", "message"),
    [
        ([([0, 1], 0)], 1, "groups of [2] layers for [1] layer slots"),
        ([([1], 0), ([1], 10)], 1, "its groups hold layers [1, 1]"),
        ([([1], 0), ([0], 12)], 1, "layer 0's group keeps a 12-token window, the layer's is 10"),
        ([([0], 0), ([1], 10)], 1, "layer 1's group keeps a 10-token window, the layer's is 0"),
    ],
)
def test_a_layout_that_does_not_match_the_model_is_refused_in_one_line(groups, slots, message):
    with pytest.raises(InvalidArgument, match="the pool's KV groups do not match the model") as refused:
        pool_layout(handle(groups, slots), WINDOWS)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_groups_without_a_shape_are_refused_in_one_line():
    shapeless = common_pb2.PoolHandle(kv_groups=GROUPED.kv_groups)
    shapeless.kv_groups[0].layers.append(0)
    shapeless.kv_groups.pop()
    with pytest.raises(InvalidArgument, match=r"groups of \[2\] layers for \[\] layer slots"):
        pool_layout(shapeless, WINDOWS)


def test_one_group_of_every_layer_keeps_every_block_for_any_window():
    layout = pool_layout(handle([([0, 1], 0)], 2), WINDOWS)
    assert (layout.slots, layout.num_groups) == ((0, 1), 1)
    assert pool_layout(common_pb2.PoolHandle(shape=[2, 2, 4, BS, 1, 8]), WINDOWS).slots == (0, 1)


def test_a_step_must_send_a_table_per_group():
    limits = Limits(100, 64, NUM_BLOCKS, BS, num_groups=2)
    with pytest.raises(InvalidArgument, match="num_kv_groups is 1, the attached pool has 2 KV groups"):
        ForwardBatch.from_request(forward_request([[1, 2]], [0], [[3]], block_size=BS), limits)
    request = grouped_request([[1, 2]], [0], [[[3]], [[4]]])
    request.block_tables[1] = NUM_BLOCKS
    with pytest.raises(
        InvalidArgument, match="group 1's block_tables\\[0\\]\\[0\\] = 64 is outside the pool"
    ):
        ForwardBatch.from_request(request, limits)
