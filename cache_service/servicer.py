"""The pagedserve.v1.Cache servicer: one pool, one block manager, every RPC under one lock."""

import threading

import torch

from cache_service import block_map, image_store, messages
from cache_service.block_manager import BlockManager
from cache_service.hybrid_blocks import HybridBlocks
from cache_service.kv_events import publisher as kv_events
from cache_service.kv_pool import KVPool, pool_groups, shard_ranks, spec_from_request
from cache_service.options import DEFAULT_IMAGE_STORE_MEMORY, DEFAULT_SESSION_TTL_S
from cache_service.sequence import check_prompt
from cache_service.sessions import Sessions
from cache_service.tiers import manager as tiers
from common.devices import CPU, Device
from common.errors import FailedPrecondition
from common.kv_groups import group_size
from protos import cache_pb2, cache_pb2_grpc, common_pb2


class CacheServicer(cache_pb2_grpc.CacheServicer):
    """Owns at most one pool, whose layout is fixed once created; its budget defaults to the service's
    --kv-blocks or --kv-memory. Raw K/V leaves only with debug_read_kv (--debug-read-kv)."""

    def __init__(
        self,
        allocator: str,
        default_blocks: int,
        default_memory: int,
        log,
        prefix_caching: bool = True,
        sessions: Sessions | None = None,
        debug_read_kv: bool = False,
        tier: tiers.TierManager | None = None,
        device: Device = CPU,
        events: kv_events.EventPublisher | None = None,
        image_store_memory: int = DEFAULT_IMAGE_STORE_MEMORY,
    ) -> None:
        self._allocator = allocator
        self._device = device
        self._attention_backend = ""
        self._debug_read_kv = debug_read_kv
        self._prefix_caching = prefix_caching
        self._default_blocks = default_blocks
        self._default_memory = default_memory
        self._log = log
        self._lock = threading.Lock()
        self._pool: KVPool | None = None
        self._tier = tier or tiers.NoTier()
        self._events = events
        self._image_store_memory = image_store_memory
        self._images: image_store.ImageStore | None = None
        # Ended sessions whose image leases end once no step of an ended session runs (Sessions.num_ending).
        self._images_ending: list[str] = []
        # NOTE: `is None`, not `or`: Sessions has a length, and an empty one is falsy.
        self._sessions = (
            Sessions(DEFAULT_SESSION_TTL_S, DEFAULT_SESSION_TTL_S) if sessions is None else sessions
        )

    def CreatePool(self, request: cache_pb2.CreatePoolRequest, context) -> common_pb2.PoolHandle:
        with self._lock:
            groups = pool_groups(request)
            slots = group_size(groups) * shard_ranks(request)
            spec = spec_from_request(request, self._default_blocks, self._default_memory, slots)
            if self._pool is not None:
                self._pool.require_layout(spec, request.model, request.kv_scales_id, groups)
                if request.num_blocks or request.memory_bytes:
                    self._pool.require_size(spec)
                self._attention_backend = request.attention_backend
                return self._pool.handle
            self._pool = KVPool.create(
                spec,
                request.model,
                self._allocator,
                self._prefix_caching,
                request.kv_scales_id,
                self._device,
                groups,
                shard_ranks(request),
            )
            try:
                self._images = image_store.create(request, self._pool.handle, self._image_store_memory)
            except BaseException:
                self._pool.release()
                self._pool = None
                raise
            self._log.info(
                "pool_created",
                shape=list(spec.shape),
                window=self._pool.window,
                kv_groups=[[len(group.layers), group.window] for group in groups],
                dtype=self._pool.handle.dtype,
                mib=round(spec.nbytes / 2**20, 1),
                epoch=self._pool.handle.epoch,
                device=self._pool.handle.device,
                path=self._pool.handle.shm.path,
                image_store_mib=round(self._images.capacity / 2**20, 1) if self._images else 0,
            )
            self._tier.attach(self._pool)
            if self._events is not None:
                self._events.attach(self._pool.blocks)
            self._sessions.attach(self._pool.fence)
            self._attention_backend = request.attention_backend
            return self._pool.handle

    def Reserve(self, request: cache_pb2.ReserveRequest, context) -> cache_pb2.BlockTables:
        with self._lock:
            blocks = self._owning(request.session_id, [seq.seq_id for seq in request.running_seqs])
            new = [messages.seq_request(seq) for seq in request.new_seqs]
            running = [messages.seq_request(seq) for seq in request.running_seqs]
            blocks.check(new, running)
            self._tier.load_prefixes(blocks, new)
            tails = self._pool.grouped(blocks.reserve(new, running))
            seq_ids = [seq.seq_id for seq in (*request.new_seqs, *request.running_seqs)]
            written = [tail.cached_tokens for tail in tails[0][: len(new)]]
            written += [seq.num_computed for seq in request.running_seqs]
            self._sessions.reserved(request.session_id, list(zip(seq_ids, written, strict=True)))
            return messages.block_tables(seq_ids, tails, blocks.num_available)

    def Lookup(self, request: cache_pb2.LookupRequest, context) -> cache_pb2.LookupResponse:
        with self._lock:
            progress = dict(request.num_computed)
            blocks = self._owning(request.session_id, progress) if progress else self._blocks()
            prompts = [messages.seq_request(seq) for seq in request.seqs]
            for prompt in prompts:
                check_prompt(prompt)
            blocks.index_written(progress)
            self._tier.load_prefixes(blocks, prompts)
            return messages.lookup_response([blocks.prefix_blocks(p) for p in prompts], blocks)

    def Fork(self, request: cache_pb2.ForkRequest, context) -> cache_pb2.BlockTables:
        with self._lock:
            blocks = self._owning(request.session_id, [request.parent_id])
            tables = self._pool.grouped(blocks.fork(request.parent_id, list(request.child_ids)))
            self._sessions.forked(request.session_id, request.parent_id, list(request.child_ids))
            return messages.forked_tables(list(request.child_ids), tables, blocks.num_available)

    def Free(self, request: cache_pb2.FreeRequest, context) -> cache_pb2.FreeResponse:
        with self._lock:
            blocks = self._owning(request.session_id, request.seq_ids)
            appended = {seq_id: list(t.token_ids) for seq_id, t in request.appended_token_ids.items()}
            freed = blocks.free(list(request.seq_ids), dict(request.num_computed), appended)
            self._sessions.freed(request.session_id, list(request.seq_ids))
            return cache_pb2.FreeResponse(freed_blocks=freed, available_blocks=blocks.num_available)

    def OpenSession(self, request: cache_pb2.OpenSessionRequest, context) -> cache_pb2.Session:
        with self._lock:
            self._sweep()
            session = self._sessions.open(request.session_id, request.ttl_s)
            self._log.info("session_opened", session_id=request.session_id, ttl_s=session.ttl_s)
            return messages.session(request.session_id, session)

    def RenewSession(self, request: cache_pb2.RenewSessionRequest, context) -> cache_pb2.Session:
        with self._lock:
            self._sweep()
            return messages.session(request.session_id, self._sessions.renew(request.session_id))

    def CloseSession(self, request: cache_pb2.CloseSessionRequest, context) -> cache_pb2.CloseSessionResponse:
        with self._lock:
            self._sweep()
            held, freed = self._sessions.close(request.session_id, self._pool and self._pool.blocks)
            self._end_image_leases([request.session_id])
            self._log.info("session_closed", session_id=request.session_id, num_sequences=held)
            return cache_pb2.CloseSessionResponse(num_sequences=held, freed_blocks=freed)

    def sweep(self) -> None:
        """Lapses the sessions past their deadline (also done at the start of every session-aware call)."""
        with self._lock:
            self._sweep()

    def GetStats(self, request: cache_pb2.GetStatsRequest, context) -> cache_pb2.CacheStats:
        with self._lock:
            self._sweep()
            if self._pool is None:
                return cache_pb2.CacheStats(
                    allocator=self._allocator,
                    prefix_caching=self._prefix_caching,
                    num_sessions=len(self._sessions),
                    kv_tier=self._tier.stats(),
                )
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
                kv_dtype=self._pool.handle.dtype,
                device=self._pool.handle.device,
                attention_backend=self._attention_backend,
                sliding_window=self._pool.window,
                kv_groups=[
                    cache_pb2.KVGroupStats(
                        num_layers=len(group.layers), window=group.window, held_blocks=held
                    )
                    for group, held in zip(self._pool.groups, self._pool.held_blocks(), strict=True)
                ],
                prefix_query_tokens=stats.prefix_query_tokens,
                prefix_hit_tokens=stats.prefix_hit_tokens,
                copy_on_writes=stats.copy_on_writes,
                evictions=stats.evictions,
                allocator_stats=self._pool.blocks.allocator.stats(),
                stored_tokens=stats.stored_tokens,
                table_slots=stats.table_slots,
                num_sessions=len(self._sessions),
                kv_tier=self._tier.stats(),
                image_store=self._images.stats() if self._images else None,
            )

    def AcquireImages(
        self, request: cache_pb2.ImageStoreAcquireRequest, context
    ) -> cache_pb2.ImageStoreLeases:
        with self._lock:
            self._owning(request.session_id, ())
            store = image_store.require(self._images)
            keys = [(image.key, image.nbytes) for image in request.images]
            return image_store.leases(store.acquire(request.session_id, keys))

    def ReleaseImages(
        self, request: cache_pb2.ImageStoreReleaseRequest, context
    ) -> cache_pb2.ImageStoreReleaseResponse:
        with self._lock:
            self._owning(request.session_id, ())
            store = image_store.require(self._images)
            store.release(request.session_id, [(image.key, image.written) for image in request.images])
            return cache_pb2.ImageStoreReleaseResponse()

    def ReadBlock(self, request: cache_pb2.ReadBlockRequest, context) -> cache_pb2.BlockContents:
        if request.include_data and not self._debug_read_kv:
            raise FailedPrecondition(
                "ReadBlock include_data returns raw K/V, which holds other requests' prompts: start the "
                "cache service with --debug-read-kv to allow it (refcounts need no flag)"
            )
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
                reply.data = data.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
            return reply

    def GetBlockMap(self, request: cache_pb2.GetBlockMapRequest, context) -> cache_pb2.BlockMap:
        with self._lock:
            pool = self._require_pool()
            reply = block_map.encode(pool.blocks, pool.handle.epoch)
            if self._images is not None:
                reply.image_store.CopyFrom(self._images.stats())
            return reply

    def close(self) -> None:
        """Once the server has stopped: the tier stores what it is to keep (a planned stop, see
        tiers.manager.StopFlush), then the pool's segment is unlinked."""
        with self._lock:
            try:
                self._tier.close()
            finally:
                if self._pool is not None:
                    self._pool.release()
                    self._log.info("pool_released", path=self._pool.handle.shm.path)
                    self._pool = None
                if self._events is not None:
                    self._events.close()

    def _require_pool(self) -> KVPool:
        if self._pool is None:
            raise FailedPrecondition("no pool: call CreatePool first")
        return self._pool

    def _blocks(self) -> BlockManager | HybridBlocks:
        return self._require_pool().blocks

    def _owning(self, session_id: str, seq_ids) -> BlockManager | HybridBlocks:
        """The block manager, once lapsed sessions are swept and the session is checked to hold seq_ids."""
        self._sweep()
        blocks = self._blocks()
        self._sessions.check_owns(session_id, seq_ids)
        return blocks

    def _sweep(self) -> None:
        lapsed = self._sessions.sweep(self._pool and self._pool.blocks)
        for session_id in lapsed:
            self._log.warning("session_lapsed", session_id=session_id)
        self._end_image_leases(lapsed)

    def _end_image_leases(self, session_ids: list[str]) -> None:
        """Ends the image leases of ended sessions, once no step of an ended session runs: one still
        running may be writing a pending entry's range, which must not be handed out before it is over."""
        if self._images is None:
            return
        self._images_ending += session_ids
        if not self._sessions.num_ending:
            for session_id in self._images_ending:
                self._images.end_session(session_id)
            self._images_ending.clear()
