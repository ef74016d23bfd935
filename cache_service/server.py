"""The pagedserve.v1.Cache gRPC service: one pool, one block manager, every RPC under one lock."""

import argparse
import threading
from collections.abc import Sequence

import torch

from cache_service import metrics
from cache_service.allocators import registry
from cache_service.block_manager import BlockManager
from cache_service.kv_pool import KVPool, spec_from_request
from cache_service.options import DEFAULT_KV_MEMORY, OPTIONS
from cache_service.sequence import SeqRequest
from common import shared_pool
from common.errors import FailedPrecondition, InvalidArgument
from common.logging import configure
from common.metrics import serve_metrics
from common.server import serve
from protos import cache_pb2, cache_pb2_grpc, common_pb2

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name


class CacheServicer(cache_pb2_grpc.CacheServicer):
    """Owns at most one pool; its budget defaults to the service's --kv-blocks or --kv-memory."""

    def __init__(
        self, allocator: str, default_blocks: int, default_memory: int, log, prefix_caching: bool = True
    ) -> None:
        self._allocator = allocator
        self._prefix_caching = prefix_caching
        self._default_blocks = default_blocks
        self._default_memory = default_memory
        self._log = log
        self._lock = threading.Lock()
        self._pool: KVPool | None = None

    def CreatePool(self, request: cache_pb2.CreatePoolRequest, context) -> common_pb2.PoolHandle:
        with self._lock:
            spec = spec_from_request(request, self._default_blocks, self._default_memory)
            old = self._pool
            if old is not None and old.same_layout(spec, request.model):
                return old.handle
            held = old.blocks.stats().num_sequences if old is not None else 0
            if held:
                raise FailedPrecondition(
                    f"a pool with another layout holds {held} sequences: "
                    "Free them before creating a pool with a new geometry, block_size or dtype"
                )
            # NOTE: create before releasing, so a failed create leaves the old pool in place.
            self._pool = KVPool.create(spec, request.model, self._allocator, self._prefix_caching)
            if old is not None:
                old.release()
            self._log.info(
                "pool_created",
                shape=list(spec.shape),
                dtype=self._pool.handle.dtype,
                mib=round(spec.nbytes / 2**20, 1),
                epoch=self._pool.handle.epoch,
                path=self._pool.handle.shm.path,
            )
            return self._pool.handle

    def Reserve(self, request: cache_pb2.ReserveRequest, context) -> cache_pb2.BlockTables:
        with self._lock:
            blocks = self._blocks()
            new = [_seq_request(seq) for seq in request.new_seqs]
            tails = blocks.reserve(new, [_seq_request(seq) for seq in request.running_seqs])
            seq_ids = [seq.seq_id for seq in (*request.new_seqs, *request.running_seqs)]
            return cache_pb2.BlockTables(
                tables=[
                    cache_pb2.BlockTable(
                        seq_id=seq_id,
                        block_ids=tail.block_ids,
                        cached_tokens=tail.cached_tokens,
                        first_block=tail.first,
                    )
                    for seq_id, tail in zip(seq_ids, tails, strict=True)
                ],
                available_blocks=blocks.num_available,
            )

    def Fork(self, request: cache_pb2.ForkRequest, context) -> cache_pb2.BlockTables:
        with self._lock:
            blocks = self._blocks()
            tables = blocks.fork(request.parent_id, list(request.child_ids))
            return cache_pb2.BlockTables(
                tables=[
                    cache_pb2.BlockTable(seq_id=seq_id, block_ids=table)
                    for seq_id, table in zip(request.child_ids, tables, strict=True)
                ],
                available_blocks=blocks.num_available,
            )

    def Free(self, request: cache_pb2.FreeRequest, context) -> cache_pb2.FreeResponse:
        with self._lock:
            blocks = self._blocks()
            freed = blocks.free(list(request.seq_ids), dict(request.num_computed))
            return cache_pb2.FreeResponse(freed_blocks=freed, available_blocks=blocks.num_available)

    def GetStats(self, request: cache_pb2.GetStatsRequest, context) -> cache_pb2.CacheStats:
        with self._lock:
            if self._pool is None:
                return cache_pb2.CacheStats(allocator=self._allocator, prefix_caching=self._prefix_caching)
            stats = self._pool.blocks.stats()
            return cache_pb2.CacheStats(
                total_blocks=stats.total_blocks,
                used_blocks=stats.used_blocks,
                free_blocks=stats.free_blocks,
                cached_blocks=stats.cached_blocks,
                num_sequences=stats.num_sequences,
                block_size=stats.block_size,
                usage=stats.usage,
                allocator=self._allocator,
                pool_epoch=self._pool.handle.epoch,
                prefix_caching=self._prefix_caching,
                prefix_query_tokens=stats.prefix_query_tokens,
                prefix_hit_tokens=stats.prefix_hit_tokens,
                copy_on_writes=stats.copy_on_writes,
                evictions=stats.evictions,
                allocator_stats=self._pool.blocks.allocator.stats(),
                stored_tokens=stats.stored_tokens,
                table_slots=stats.table_slots,
            )

    def ReadBlock(self, request: cache_pb2.ReadBlockRequest, context) -> cache_pb2.BlockContents:
        with self._lock:
            pool = self._require_pool()
            data = pool.read_block(request.layer, request.block_id)
            reply = cache_pb2.BlockContents(
                block_id=request.block_id,
                refcount=pool.blocks.refcount(request.block_id),
                dtype=pool.handle.dtype,
                shape=list(data.shape),
            )
            if request.include_data:
                reply.data = data.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            return reply

    def close(self) -> None:
        """Unlinks the pool's segment; called once the server has stopped."""
        with self._lock:
            if self._pool is not None:
                self._pool.release()
                self._log.info("pool_released", path=self._pool.handle.shm.path)
                self._pool = None

    def _require_pool(self) -> KVPool:
        if self._pool is None:
            raise FailedPrecondition("no pool: call CreatePool first")
        return self._pool

    def _blocks(self) -> BlockManager:
        return self._require_pool().blocks


def _seq_request(seq: cache_pb2.SequenceRequest) -> SeqRequest:
    return SeqRequest(seq.seq_id, seq.num_tokens, list(seq.token_ids), seq.num_computed, seq.cache_salt)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = OPTIONS.parser(__doc__)
    args = parser.parse_args(argv)
    try:
        registry.resolve(args.allocator)
    except InvalidArgument as err:
        parser.error(str(err))
    if args.kv_blocks is None and args.kv_memory is None:
        args.kv_memory = DEFAULT_KV_MEMORY
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    log = configure("cache", args.log_format, args.log_level)
    removed = shared_pool.sweep_stale()
    log.info("swept_stale_segments", count=len(removed), paths=[str(path) for path in removed])
    servicer = CacheServicer(args.allocator, args.kv_blocks or 0, args.kv_memory or 0, log, args.prefix_cache)
    metrics.register(lambda: servicer.GetStats(cache_pb2.GetStatsRequest(), None))
    serve_metrics(args.host, args.metrics_port, log)
    server = serve(
        [(cache_pb2_grpc.add_CacheServicer_to_server, servicer, SERVICE_NAME)], args.host, args.port, log
    )
    server.wait(on_stop=servicer.close)
