"""The cache service as a real process for tests, a small pool geometry and request builders."""

import shutil
import tempfile
from pathlib import Path

import grpc
import pytest

from common.server import channel
from protos import cache_pb2, cache_pb2_grpc
from tests.helpers import start, stop, wait_healthy

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 2, 2, 16, 16


def pool_request(block_size: int = BLOCK_SIZE, **budget) -> cache_pb2.CreatePoolRequest:
    geometry = cache_pb2.PoolGeometry(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)
    return cache_pb2.CreatePoolRequest(geometry=geometry, block_size=block_size, kv_dtype="float32", **budget)


def seqs(*pairs: tuple[str, int]) -> list[cache_pb2.SequenceRequest]:
    return [cache_pb2.SequenceRequest(seq_id=seq_id, num_tokens=n) for seq_id, n in pairs]


class Service:
    """The cache service on a unix socket in a temporary directory of its own (removed by stop())."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.socket_dir = Path(tempfile.mkdtemp(prefix="ps-"))
        socket = self.socket_dir / "cache.sock"
        self.target = f"unix:{socket}"
        self.proc = start("cache_service", "--socket", str(socket), *args, log_path=tmp / "cache.log")
        try:
            wait_healthy(self.target, self.proc, timeout=60)
        except Exception:
            stop(self.proc)
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            raise
        self.channel = channel(self.target)
        self.stub = cache_pb2_grpc.CacheStub(self.channel)

    def stats(self) -> cache_pb2.CacheStats:
        return self.stub.GetStats(cache_pb2.GetStatsRequest())

    def log(self) -> str:
        return Path(self.proc.log_path).read_text()

    def stop(self) -> int:
        self.channel.close()
        code = stop(self.proc)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        return code


def refused(call, request, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    assert info.value.code() == code, info.value.details()
    return info.value.details()
