"""Every allocator behind the real cache service; copy-on-write of K and V in every layer over gRPC."""

import grpc
import pytest
import torch

from cache_service.allocators import registry
from common.shared_pool import open_pool
from protos import cache_pb2
from tests.e2e.cache_process import LAYERS, Service, pool_request, refused, seqs

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("allocator", [*registry.available(), "tests.toy_allocator:StackAllocator"])
def test_every_allocator_serves_and_refuses_exhaustion_cleanly(tmp_path, allocator):
    service = Service(tmp_path, "--kv-blocks", "4", "--allocator", allocator)
    try:
        stub = service.stub
        stub.CreatePool(pool_request())
        (table,) = stub.Reserve(cache_pb2.ReserveRequest(new_seqs=seqs(("a", 40)))).tables
        assert len(set(table.block_ids)) == 3
        message = refused(stub.Reserve, cache_pb2.ReserveRequest(new_seqs=seqs(("b", 32))),
                          grpc.StatusCode.RESOURCE_EXHAUSTED)  # fmt: skip
        assert "need 2 blocks, 1 free of 4" in message
        refused(stub.Free, cache_pb2.FreeRequest(seq_ids=["a", "ghost"]), grpc.StatusCode.NOT_FOUND)
        stub.Free(cache_pb2.FreeRequest(seq_ids=["a"]))
        stats = service.stats()
        assert (stats.allocator, stats.used_blocks, stats.free_blocks) == (allocator, 0, 4)
        if allocator == "contiguous":
            assert stats.allocator_stats["placements"] == 2 and stats.allocator_stats["adjacent_ratio"] == 1
    finally:
        service.stop()


def test_a_write_into_a_forked_block_copies_k_and_v_of_every_layer(tmp_path):
    service = Service(tmp_path, "--kv-blocks", "8")
    try:
        stub = service.stub
        handle = stub.CreatePool(pool_request())
        tokens = list(range(20))
        request = cache_pb2.SequenceRequest(seq_id="p", num_tokens=20, token_ids=tokens)
        (parent,) = stub.Reserve(cache_pb2.ReserveRequest(new_seqs=[request])).tables
        pool = open_pool(handle)
        shared = parent.block_ids[1]
        pool[:, :, shared] = torch.randn(pool[:, :, shared].shape)
        (child,) = stub.Fork(cache_pb2.ForkRequest(parent_id="p", child_ids=["c"])).tables
        assert list(child.block_ids) == list(parent.block_ids)
        write = cache_pb2.SequenceRequest(seq_id="c", num_tokens=20, num_computed=19)
        (tail,) = stub.Reserve(cache_pb2.ReserveRequest(running_seqs=[write])).tables
        assert tail.first_block == 1, "the step writes from the second block on"
        copy = tail.block_ids[0]
        assert copy != shared
        assert torch.equal(pool[:, :, copy], pool[:, :, shared]) and pool[:, :, copy].abs().sum() > 0
        assert pool.shape[0] == LAYERS
        stats = service.stats()
        assert (stats.copy_on_writes, stats.used_blocks) == (1, 3)
        stub.Free(cache_pb2.FreeRequest(seq_ids=["p", "c"], num_computed={"p": 20, "c": 20}))
        stats = service.stats()
        assert (stats.used_blocks, stats.cached_blocks) == (0, 1), (
            "p's first block (its only full one) is cached"
        )
    finally:
        service.stop()
