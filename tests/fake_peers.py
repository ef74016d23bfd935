"""Stand-ins for the cache and compute stubs that can die and restart, for the engine's unit tests.

`FakeCompute` keeps the K/V it was given per (epoch, block, offset) and samples from what it reads back
through the block tables, so a recompute that skips tokens or trusts a lost pool fails (KeyError) or
samples differently."""

import threading
from collections.abc import Callable

import grpc

from common.errors import RowsRefused
from protos import cache_pb2, common_pb2, compute_pb2
from tests.fake_cache import FakeCache, RpcError

VOCAB = 100
STEP_S = 0.005


def unreachable(service: str) -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE, f"failed to connect to the {service} service")


class FakePoolCache(FakeCache):
    """A FakeCache with CreatePool and sessions; `down` refuses every call, `restart()` loses the pool, every
    table and every session; a Reserve sending a token of `broken` fails with INTERNAL naming no sequence,
    having changed nothing."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.num_blocks, self.epoch, self.restarts, self.down = num_blocks, "", 0, False
        self.sessions: set[str] = set()
        self.broken: set[int] = set()

    def restart(self, num_blocks: int | None = None) -> None:
        """A new process at the same address (with another pool size if given): no pool, no tables."""
        self.__init__(num_blocks or self.num_blocks, self.block_size)

    def CreatePool(self, request: cache_pb2.CreatePoolRequest, **_) -> common_pb2.PoolHandle:
        self._check()
        self.epoch = self.epoch or f"epoch-{id(self.free)}"
        shape = [request.geometry.num_layers, 2, self.num_blocks, request.block_size, 1, 4]
        return common_pb2.PoolHandle(epoch=self.epoch, shape=shape, dtype=request.kv_dtype)

    def OpenSession(self, request: cache_pb2.OpenSessionRequest, **_) -> cache_pb2.Session:
        self._check()
        self.sessions.add(request.session_id)
        return cache_pb2.Session(session_id=request.session_id, ttl_s=request.ttl_s)

    def RenewSession(self, request: cache_pb2.RenewSessionRequest, **_) -> cache_pb2.Session:
        self._check()
        if request.session_id not in self.sessions:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"unknown session {request.session_id!r}")
        return cache_pb2.Session(session_id=request.session_id)

    def CloseSession(self, request: cache_pb2.CloseSessionRequest, **_) -> cache_pb2.CloseSessionResponse:
        self._check()
        self.sessions.discard(request.session_id)
        return cache_pb2.CloseSessionResponse()

    def Reserve(self, request, **kw):
        self._check(pool=True)
        if any(self.broken & set(seq.token_ids) for seq in (*request.new_seqs, *request.running_seqs)):
            raise RpcError(grpc.StatusCode.INTERNAL, "a fault in the cache service")
        return super().Reserve(request, **kw)

    def Lookup(self, request, **kw):
        self._check(pool=True)
        return super().Lookup(request, **kw)

    def Fork(self, request, **kw):
        self._check(pool=True)
        return super().Fork(request, **kw)

    def Free(self, request, **kw):
        self._check(pool=True)
        return super().Free(request, **kw)

    def _check(self, pool: bool = False) -> None:
        if self.down:
            raise unreachable("cache")
        if pool and not self.epoch:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "no pool: call CreatePool first")


class FakeCompute:
    """`down` refuses every call; `restart()` detaches the pool; `before[n]()` runs at the start of the n-th
    step (a Forward, or a step of a ForwardSteps call) and may raise, as a dying process's call does; a step
    with a row holding a token of `refused` is refused (INVALID_ARGUMENT) naming those rows, as the real
    compute does, before anything is written; one holding a token of `broken` fails with INTERNAL naming no
    row, after writing its K/V (a fault in the model's code). `computed` counts the tokens of the steps
    that completed. Block size 4."""

    def __init__(self) -> None:
        self.kv: dict[tuple[str, int, int], int] = {}
        self.epoch: str | None = None
        self.down = False
        self.before: dict[int, Callable[[], None]] = {}
        self.forwards = 0
        # Steps each ForwardSteps call ran, in call order.
        self.call_steps: list[int] = []
        self.refused: set[int] = set()
        self.broken: set[int] = set()
        self.computed = 0

    def restart(self) -> None:
        self.epoch = None

    def GetModelInfo(self, request, **_) -> compute_pb2.ModelInfo:
        self._check()
        return compute_pb2.ModelInfo(model="fake", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32",
                                     vocab_size=VOCAB, max_model_len=512)  # fmt: skip

    def AttachPool(self, handle: common_pb2.PoolHandle, **_) -> compute_pb2.AttachPoolResponse:
        self._check()
        self.epoch = handle.epoch
        return compute_pb2.AttachPoolResponse(epoch=handle.epoch, num_blocks=handle.shape[2])

    def ForwardSteps(self, requests, **_):
        """As the real compute: the first message's step, then each row's sampled token fed into the next
        step until its max_steps or a stop id, or until the caller half-closes (checked between steps)."""
        self._check()
        first = next(requests)
        stop = threading.Event()
        threading.Thread(target=lambda: (next(requests, None), stop.set()), daemon=True).start()
        return self._steps(first, stop)

    def _steps(self, first: compute_pb2.StepsRequest, stop: threading.Event):
        request, cu, rows = first.first, first.cu_stop_token_ids, list(range(len(first.max_steps)))
        taken = [0] * len(rows)
        self.call_steps.append(0)
        while rows:
            self.call_steps[-1] += 1
            reply = self.Forward(request)
            reply.rows.extend(rows)
            for row, token in zip(rows, reply.token_ids, strict=True):
                taken[row] += 1
                if taken[row] >= first.max_steps[row] or token in first.stop_token_ids[cu[row] : cu[row + 1]]:
                    taken[row] = -1
            keep = [i for i, row in enumerate(rows) if taken[row] >= 0]
            # NOTE: a step's time, in which the caller's half-close arrives (the fake's steps take none).
            stopping = stop.wait(STEP_S)
            reply.running.extend(taken[row] >= 0 and not stopping for row in rows)
            yield reply
            if stopping or not keep:
                return
            rows = [rows[i] for i in keep]
            request = _next_step(request, list(reply.token_ids), keep)

    def Forward(self, request: compute_pb2.ForwardRequest, **_) -> compute_pb2.ForwardResponse:
        self._check()
        self.forwards += 1
        if self.forwards in self.before:
            self.before.pop(self.forwards)()
        if request.pool_epoch != self.epoch:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "no KV pool attached")
        self._refuse_rows(request)
        width, block_size, tokens = request.block_table_width, 4, []
        for i, computed in enumerate(request.num_computed):
            table = request.block_tables[i * width : (i + 1) * width]
            chunk = request.token_ids[request.cu_seqlens_q[i] : request.cu_seqlens_q[i + 1]]
            slots = [
                (self.epoch, table[p // block_size], p % block_size) for p in range(computed + len(chunk))
            ]
            for slot, token in zip(slots[computed:], chunk, strict=True):
                self.kv[slot] = token
            if request.sample[i]:
                context = [self.kv[slot] for slot in slots]
                tokens.append(3 + sum((pos + 1) * t for pos, t in enumerate(context)) % (VOCAB - 3))
        if self.broken & set(request.token_ids):
            raise RpcError(grpc.StatusCode.INTERNAL, "RuntimeError: a fault in the model's code")
        self.computed += len(request.token_ids)
        return compute_pb2.ForwardResponse(token_ids=tokens, logprobs=[0.0] * len(tokens))

    def _refuse_rows(self, request: compute_pb2.ForwardRequest) -> None:
        cu = request.cu_seqlens_q
        rows = [i for i in range(len(cu) - 1) if self.refused & set(request.token_ids[cu[i] : cu[i + 1]])]
        if rows:
            error = RowsRefused(f"token_ids hold a token of {sorted(self.refused)}", rows)
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(error), error.trailing_metadata())

    def _check(self) -> None:
        if self.down:
            raise unreachable("compute")


def _next_step(
    request: compute_pb2.ForwardRequest, tokens: list[int], keep: list[int]
) -> compute_pb2.ForwardRequest:
    """The decode step after `request` for its rows `keep`, each feeding the token it sampled (the fake reads
    no sampling controls)."""
    width = request.block_table_width
    return compute_pb2.ForwardRequest(
        pool_epoch=request.pool_epoch,
        token_ids=[tokens[i] for i in keep],
        cu_seqlens_q=range(len(keep) + 1),
        num_computed=[request.num_computed[i] + 1 for i in keep],
        block_tables=[b for i in keep for b in request.block_tables[i * width : (i + 1) * width]],
        block_table_width=width,
        sample=[True] * len(keep),
    )
