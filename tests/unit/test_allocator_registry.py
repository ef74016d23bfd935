"""Allocators by name: built-ins, entry points of the group pagedserve.allocators, dotted paths."""

from importlib import metadata

import pytest

from cache_service.allocators import registry
from cache_service.allocators.contiguous import ContiguousAllocator
from cache_service.sequence import SeqRequest
from common.errors import InvalidArgument
from tests.blocks import allocate
from tests.fake_pool import manager
from tests.toy_allocator import StackAllocator

TOY = "tests.toy_allocator:StackAllocator"


def test_a_dotted_path_loads_a_third_party_allocator():
    assert registry.resolve(TOY) is StackAllocator
    blocks, _ = manager(8, TOY)
    (table,) = allocate(blocks, [SeqRequest("a", 8)])
    assert blocks.stats().used_blocks == len(table) == 2
    blocks.free(["a"])
    blocks.check_invariants()


def test_an_entry_point_loads_a_third_party_allocator(monkeypatch):
    point = metadata.EntryPoint("toy", TOY, registry.PLUGINS.entry_point_group)

    def entry_points(group: str):
        return [point] if group == registry.PLUGINS.entry_point_group else []

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    assert "toy" in registry.available()
    assert isinstance(registry.create("toy", 4), StackAllocator)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("buddy", "unknown allocator 'buddy'"),
        ("tests.toy_allocator:Missing", "cannot load allocator"),
        ("no_such_module:Class", "cannot load allocator"),
        ("tests.toy_allocator:Sequence", "not a BlockAllocator subclass"),
    ],
)
def test_bad_names_are_refused(name, message):
    with pytest.raises(InvalidArgument, match=message):
        registry.resolve(name)


def test_contiguous_keeps_a_sequence_adjacent_and_reports_how_often():
    allocator = ContiguousAllocator(8)
    a = allocator.allocate(2)
    b = allocator.allocate(2)
    assert (a, b) == ([0, 1], [2, 3])
    assert allocator.allocate(1, hint=b) == [4]
    assert allocator.allocate(1, hint=a) == [5], "block 2 is taken: the lowest free block instead"
    assert allocator.stats() == {"placements": 4, "adjacent": 3, "adjacent_ratio": 0.75}
