"""KV groups: layers split into equal groups by attention pattern, and what a sliding group keeps."""

import pytest

from common.errors import InvalidArgument
from common.kv_groups import KVGroup, group_layers, group_size, window_blocks


def test_a_model_without_windows_is_one_group_of_all_layers():
    assert group_layers([0] * 4) == (KVGroup((0, 1, 2, 3)),)


def test_all_sliding_layers_are_one_group_with_the_window():
    assert group_layers([8] * 3) == (KVGroup((0, 1, 2), 8),)


def test_gemma3_pattern_is_one_layer_groups_full_first():
    windows = [8, 8, 8, 8, 8, 0]
    groups = group_layers(windows)
    assert groups == (KVGroup((5,)), *(KVGroup((layer,), 8) for layer in range(5)))
    assert group_size(groups) == 1


def test_alternating_layers_pair_up_by_pattern():
    groups = group_layers([8, 0] * 4)
    assert groups == (KVGroup((1, 3, 5, 7)), KVGroup((0, 2, 4, 6), 8))


def test_group_size_is_the_gcd_of_the_pattern_counts():
    windows = [4] * 4 + [0] * 2 + [4] * 2
    groups = group_layers(windows)
    assert [g.layers for g in groups] == [(4, 5), (0, 1), (2, 3), (6, 7)]
    assert sorted(layer for g in groups for layer in g.layers) == list(range(8))


@pytest.mark.parametrize("windows", [[], [0, -1]])
def test_bad_windows_are_refused(windows):
    with pytest.raises(InvalidArgument):
        group_layers(windows)


@pytest.mark.parametrize(
    ("num_computed", "first"),
    [(0, 0), (8, 0), (11, 0), (12, 1), (15, 1), (16, 2), (100, 23)],
)
def test_first_kept_block_holds_the_first_querys_window(num_computed, first):
    # window 9, block size 4: a query at p reads keys p-8..p
    assert KVGroup((0,), 9).first_kept(num_computed, 4) == first
    assert KVGroup((0,)).first_kept(num_computed, 4) == 0


@pytest.mark.parametrize(("window", "block_size"), [(1, 4), (8, 8), (9, 8), (16, 8), (4096, 16)])
def test_a_sliding_table_never_holds_more_than_its_window_blocks(window, block_size):
    """From the block of its first kept table index to the block of the token it writes: never more than
    window_blocks, and that many or one fewer at some length (the cap the gateway counts is tight)."""
    group = KVGroup((0,), window)
    held = [n // block_size - group.first_kept(n, block_size) + 1 for n in range(4 * window + 2 * block_size)]
    assert max(held) <= window_blocks(window, block_size) <= max(held) + 1
