"""The image store's leases around a step (docs/vision.md#image-store): before a Forward with images, the
gateway asks the cache service (Cache.AcquireImages) for each image's embeddings by a key of the image's
digest, the model's identity and the row's cache salt, and tells compute where they are (a hit: read them in
place) or where to write them once encoded (a miss given room); after it, ReleaseImages ends the leases, the
misses compute wrote becoming hits for every later step, of any compute."""

import hashlib

import grpc
import structlog

from gateway.lease import Lease
from gateway.recovery import calling
from protos import cache_pb2, cache_pb2_grpc, common_pb2, compute_pb2

log = structlog.get_logger()
KEY_BYTES = 16
# A Forward that failed so may still run in compute: its misses' ranges may still be written.
IN_DOUBT = frozenset(
    (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
    )
)


def store_key(identity: bytes, salt: str, content_hash: bytes) -> bytes:
    """The image's key: its digest under the model's embedding identity and the cache salt (images are
    shared only where prefix blocks are)."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in (identity, salt.encode(), content_hash):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


class ImageLeases:
    """Leases for the images of one step at a time, on the attached pool's image store (none: no calls)."""

    def __init__(self, stub: cache_pb2_grpc.CacheStub, lease: Lease, rpc_timeout_s: float) -> None:
        self._stub, self._lease, self._timeout = stub, lease, rpc_timeout_s
        self._identity, self._token_bytes = b"", 0

    def attach(self, info: compute_pb2.ModelInfo, handle: common_pb2.PoolHandle) -> None:
        """The model and pool steps run on from now on: leases only where the pool has an image store and
        compute reports the embeddings' size."""
        vision = info.vision
        stored = (
            handle.HasField("image_store") and info.HasField("vision") and vision.embedding_token_bytes > 0
        )
        self._identity = vision.embedding_identity.encode() if stored else b""
        self._token_bytes = vision.embedding_token_bytes if stored else 0

    def acquire(self, request: compute_pb2.ForwardRequest, salts: list[str]) -> list[tuple]:
        """Leases the request's images (rows' cache salts `salts`) and writes each lease into its
        VisionImage; returns (key, lease) per image key leased (PeerFault naming the cache if the call
        fails)."""
        if not self._token_bytes or not request.images:
            return []
        keys = [store_key(self._identity, salts[image.row], image.content_hash) for image in request.images]
        unique = {
            key: image.num_tokens * self._token_bytes for key, image in zip(keys, request.images, strict=True)
        }
        call = cache_pb2.ImageStoreAcquireRequest(
            session_id=self._lease.session_id,
            images=[cache_pb2.ImageStoreKey(key=key, nbytes=nbytes) for key, nbytes in unique.items()],
        )
        with calling("cache"):
            reply = self._stub.AcquireImages(call, timeout=self._timeout)
        leases = dict(zip(unique, reply.leases, strict=True))
        for key, image in zip(keys, request.images, strict=True):
            lease = leases[key]
            image.store_hit, image.store_offset, image.store_nbytes = lease.hit, lease.offset, lease.nbytes
        return list(leases.items())

    def release(self, leased: list[tuple], ran: bool, settled: bool = True) -> None:
        """Ends the leases of a step that compute ran (a miss given room then holds the embeddings) or that
        failed (`ran` False); a failed step's call may still run in compute (not `settled`: IN_DOUBT), then
        the misses' ranges stay leased until the session ends, since compute may still write them. A failed
        ReleaseImages is logged: the step's result stands, and the leases end with the session."""
        done = [
            cache_pb2.ImageStoreRelease(key=key, written=ran and not lease.hit and lease.nbytes > 0)
            for key, lease in leased
            if settled or lease.hit or not lease.nbytes
        ]
        if not done:
            return
        call = cache_pb2.ImageStoreReleaseRequest(session_id=self._lease.session_id, images=done)
        try:
            self._stub.ReleaseImages(call, timeout=self._timeout)
        except grpc.RpcError as err:
            log.warning("image_release_failed", code=err.code().name, error=err.details())
