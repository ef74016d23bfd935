"""The start-up handshake (and the one after a peer was lost): model info from compute, a pool sized for
it (its geometry, KV dtype and fp8 scales' identity) from cache, the pool attached to compute.
The gateway orchestrates; cache and compute never call each other."""

from gateway.recovery import calling
from protos import cache_pb2, cache_pb2_grpc, common_pb2, compute_pb2, compute_pb2_grpc


def handshake(
    cache: cache_pb2_grpc.CacheStub,
    compute: compute_pb2_grpc.ComputeStub,
    block_size: int,
    timeout: float,
    wait: bool,
) -> tuple[compute_pb2.ModelInfo, common_pb2.PoolHandle]:
    """The model's info and the attached pool's handle. `wait`: wait for the peers to come up, each call
    within `timeout`. Raises PeerFault naming the peer whose call failed.

    Idempotent: CreatePool returns the pool the cache holds for this layout (its tables intact), and
    attaching it again changes nothing in compute.
    """
    with calling("compute"):
        info = compute.GetModelInfo(compute_pb2.GetModelInfoRequest(), wait_for_ready=wait, timeout=timeout)
    # NOTE: a tensor-parallel compute's ranks each keep their share of the KV heads, in a pool of their own.
    ranks = info.tensor_parallel_size or 1
    geometry = cache_pb2.PoolGeometry(
        num_layers=info.num_layers, num_kv_heads=info.num_kv_heads // ranks, head_dim=info.head_dim
    )
    # NOTE: compute owns the KV dtype (it writes and reads K/V); one that names none stores the weights'.
    request = cache_pb2.CreatePoolRequest(
        geometry=geometry,
        block_size=block_size,
        kv_dtype=info.kv_dtype or info.dtype,
        model=info.model,
        kv_scales_id=info.kv_scales_id,
        attention_backend=info.attention_backend,
        sliding_windows=info.sliding_windows,
        shard_ranks=info.tensor_parallel_size,
        image_store=info.HasField("vision"),
    )
    with calling("cache"):
        handle = cache.CreatePool(request, wait_for_ready=wait, timeout=timeout)
    with calling("compute"):
        compute.AttachPool(handle, timeout=timeout)
    return info, handle
