"""The block arithmetic against its definition: ceiling division, and block_table[t // bs] * bs + t % bs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.paging import blocks_for, slots


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "blocks"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (17, 16, 2)]
)
def test_blocks_for_rounds_up(num_tokens, block_size, blocks):
    assert blocks_for(num_tokens, block_size) == blocks


def test_blocks_for_works_elementwise_on_tensors():
    assert blocks_for(torch.tensor([0, 1, 4, 5, 9]), 4).tolist() == [0, 1, 1, 2, 3]


@settings(max_examples=50, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_rows=st.integers(1, 4),
    width=st.integers(1, 6),
    num_positions=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_slots_follow_the_formula(block_size, num_rows, width, num_positions, seed):
    generator = torch.Generator().manual_seed(seed)
    tables = torch.randperm(num_rows * width + 5, generator=generator)[: num_rows * width].view(
        num_rows, width
    )
    positions = torch.randint(0, width * block_size, (num_rows, num_positions), generator=generator)
    expected = [
        [int(tables[r, p // block_size]) * block_size + p % block_size for p in positions[r].tolist()]
        for r in range(num_rows)
    ]
    assert slots(tables, positions, block_size).tolist() == expected
    assert slots(tables[0], positions[0], block_size).tolist() == expected[0], "one table, 1-D"
