"""The dashboard's data, as JSON: the cache service's block map, the engine's running and waiting sequences
with their block tables, totals and the charts' history. A viewer with an API key sees its own sequences in
full and the others' without their ids."""

import base64
import threading
import time
from collections.abc import Iterable

import grpc

from gateway.auth import ApiKeys, Tenant
from gateway.engine_view import SeqView
from gateway.http.history import History
from protos import cache_pb2, cache_pb2_grpc

# The block map is fetched at most this often, however many pages poll (each fetch reads every block under
# the cache service's lock).
MAP_MAX_AGE_S = 0.25
MAP_TIMEOUT_S = 2.0
# One character per block state (cache_pb2.BlockState); '?' for a state this gateway does not know.
STATE_CHARS = {
    cache_pb2.BLOCK_STATE_FREE: "f",
    cache_pb2.BLOCK_STATE_USED: "u",
    cache_pb2.BLOCK_STATE_CACHED: "c",
    cache_pb2.BLOCK_STATE_NULL: "n",
}
_STATE_TABLE = bytes(ord(STATE_CHARS.get(code, "?")) for code in range(256))


def pool_json(reply: cache_pb2.BlockMap) -> dict:
    """The block map for the page: states as one character per block (f free, u used, c cached, n the null
    block sliding-window tables name before their window), refcounts as base64 bytes (capped at 255), and
    the counts; shared = used with a refcount above 1."""
    states = reply.states.translate(_STATE_TABLE).decode("ascii")
    refcounts = reply.refcounts
    return {
        "num_blocks": reply.num_blocks,
        "block_size": reply.block_size,
        "epoch": reply.pool_epoch,
        "states": states,
        "refcounts": base64.b64encode(refcounts).decode("ascii"),
        "counts": {
            "free": states.count("f"),
            "used": states.count("u"),
            "cached": states.count("c"),
            "shared": sum(count > 1 for state, count in zip(states, refcounts, strict=True) if state == "u"),
        },
        "image_store": image_store_json(reply.image_store) if reply.HasField("image_store") else None,
    }


def image_store_json(stats: cache_pb2.ImageStoreStats) -> dict:
    """The image store's figures (docs/vision.md#image-store), by their field names."""
    return {field.name: getattr(stats, field.name) for field in stats.DESCRIPTOR.fields}


def seqs_json(views: Iterable[tuple[str, SeqView]], viewer: Tenant | None) -> list[dict]:
    """(status, sequence) pairs as the viewer may see them: its own (or all, without keys) in full, any
    other key's with ids replaced by `other-N` and no request id (their blocks and counts stay)."""
    shown, others = [], 0
    for status, view in views:
        own = viewer is None or view.tenant == viewer.name
        if not own:
            others += 1
        shown.append({
            "id": view.seq_id if own else f"other-{others}",
            "request_id": view.request_id if own else "",
            "own": own,
            "status": status,
            "index": view.index,
            "prompt_tokens": view.prompt_tokens,
            "generated_tokens": view.generated_tokens,
            "computed_tokens": view.computed_tokens,
            "cached_tokens": view.cached_tokens,
            "preemptions": view.preemptions,
            "blocks": list(dict.fromkeys(block for table in view.tables for block in table)),
            "tables": [list(table) for table in view.tables],
        })  # fmt: skip
    return shown


class DashboardSource:
    """What /dashboard/state serves, read from the engine (its published view: no lock on the engine
    thread) and from the cache service (Cache.GetBlockMap, at most once per MAP_MAX_AGE_S)."""

    def __init__(self, engine, cache: cache_pb2_grpc.CacheStub, keys: ApiKeys | None) -> None:
        self.engine = engine
        self.keys = keys
        self.history = History(lambda: (engine.view.snapshot, engine.view.totals))
        self._cache = cache
        self._map_lock = threading.Lock()
        self._map: tuple[dict | None, str | None] = (None, "not fetched yet")
        self._map_at = float("-inf")

    def start(self) -> None:
        self.history.start()

    def stop(self) -> None:
        self.history.stop()

    def pool(self) -> tuple[dict | None, str | None]:
        """(the block map as pool_json, None), or (None, why it could not be read)."""
        with self._map_lock:
            if time.monotonic() - self._map_at >= MAP_MAX_AGE_S:
                try:
                    reply = self._cache.GetBlockMap(cache_pb2.GetBlockMapRequest(), timeout=MAP_TIMEOUT_S)
                    self._map = (pool_json(reply), None)
                except grpc.RpcError as err:
                    self._map = (None, f"the cache service's block map: {err.code().name}: {err.details()}")
                self._map_at = time.monotonic()
            return self._map

    def state(self, viewer: Tenant | None) -> dict:
        """Everything the page shows, for `viewer` (None: a gateway without keys)."""
        self.engine.view.watch()
        snapshot, totals = self.engine.view.snapshot, self.engine.view.totals
        pool, pool_error = self.pool()
        info = self.engine.model_info
        views = [("running", v) for v in snapshot.running] + [("waiting", v) for v in snapshot.waiting]
        prompt = totals.prompt_tokens
        return {
            "time": time.time(),
            "model": info.model if info is not None else None,
            "attached_epoch": self.engine.attached_epoch(),
            "viewer": viewer.name if viewer else None,
            "pool": pool,
            "pool_error": pool_error,
            "sequences": seqs_json(views, viewer),
            "listed": snapshot.listed,
            "num_running": snapshot.num_running,
            "num_waiting": snapshot.num_waiting,
            "kv_usage": snapshot.kv_usage,
            "totals": {
                "generated_tokens": totals.generated_tokens,
                "prompt_tokens": prompt,
                "cached_tokens": totals.cached_tokens,
                "hit_rate": totals.cached_tokens / prompt if prompt else None,
                "preemptions": snapshot.preemptions,
            },
            "history": self.history.series(),
        }
