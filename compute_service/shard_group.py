"""A tensor-parallel group of compute ranks on torch.distributed (gloo on the cpu): rank 0 serves the gateway
and drives the others, each step's batch broadcast to them before the model runs, so the gateway still
talks to one compute endpoint and sampling happens once (docs/scaling.md).

Rank 0 starts ranks 1..N-1 as processes of its own (`python -m compute_service ... --shard-rank r`) with
the same flags, unless --dist-init-addr names a rendezvous the other ranks reach by themselves (torchrun,
a LeaderWorkerSet). Every rank loads and splits the model (compute_service.tensor_parallel), then joins.

A group lives and dies whole: rank 0 exits when a rank it started exits, and a rank exits when its
broadcast fails (rank 0 gone) or its parent, rank 0, is gone; the supervisor then restarts compute, and the
gateway re-attaches the cache's pool, whose KV the streams continue from.
"""

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import structlog
import torch.distributed as dist

from compute_service import kv_pool
from compute_service.pool_layout import pool_layout
from protos import common_pb2

STEP, ATTACH, DETACH = "step", "attach", "detach"
# NOTE: a rank waits for rank 0's next step for as long as the service idles; a dead peer is found by its
# closed connection or by the process watch, never by this timeout.
IDLE_TIMEOUT = timedelta(days=365)
WATCH_S = 0.5
# Set once rank 0 stops its ranks itself: their exits are then no loss.
_stopping = threading.Event()


@dataclass
class ShardGroup:
    """This process's place in the group. Rank 0 `send`s what every rank must do next, in the order it does
    it itself; the others `serve` those messages until the group ends."""

    rank: int
    size: int
    ranks: list[subprocess.Popen] = field(default_factory=list)

    def send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0)

    @contextmanager
    def in_step(self) -> Iterator[None]:
        """Rank 0's part of a step: an error inside it (a rank gone mid-collective, or one on this rank alone)
        leaves the ranks out of step, so it ends the process, and the group with it, rather than a reply."""
        try:
            yield
        except Exception as exc:
            structlog.get_logger().error("shard_group_broken", error=str(exc), action="stopping the group")
            stop(self.ranks)
            os._exit(1)

    def attach(self, handle: common_pb2.PoolHandle) -> None:
        """Every other rank maps its own pool of `handle`'s segment."""
        self.send((ATTACH, handle.SerializeToString()))

    def serve(self, runner, windows: tuple[int, ...], device) -> None:
        """Ranks > 0: runs rank 0's steps on `runner` (this rank's split of the model) until rank 0 is
        gone."""
        log = structlog.get_logger()
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            kind, *args = message[0]
            if kind == STEP:
                # rank 0's products: its head's all-gathers take this rank's part of the vocabulary
                runner.outputs(args[0])
            elif kind == ATTACH:
                handle = common_pb2.PoolHandle.FromString(args[0])
                handle.shard_rank = self.rank
                runner.attach(kv_pool.map_kv_pool(handle, device), pool_layout(handle, windows))
                log.info("pool_attached", rank=self.rank, epoch=handle.epoch)
            else:
                runner.detach()


def rank_of(flag: int) -> int:
    """This process's rank: --shard-rank, else torchrun's RANK, else 0."""
    return flag or int(os.environ.get("RANK", "0"))


def starts_ranks(init_addr: str) -> bool:
    """Whether rank 0 starts the other ranks itself: neither --dist-init-addr nor torchrun's rendezvous
    (MASTER_ADDR) says they are started elsewhere."""
    return not init_addr and "MASTER_ADDR" not in os.environ


def start(argv: list[str], size: int, init_addr: str) -> tuple[list[subprocess.Popen], str]:
    """Rank 0: ranks 1..size-1 started with compute's `argv`, all to meet at `init_addr` (empty: a free port
    of this host's loopback); the processes and the address."""
    init_addr = init_addr or f"127.0.0.1:{_free_port()}"
    command = [sys.executable, "-m", "compute_service", *argv, "--dist-init-addr", init_addr]
    # NOTE: a session of their own: a signal to the launcher's process group reaches rank 0, which stops them.
    ranks = [
        subprocess.Popen([*command, "--shard-rank", str(rank)], start_new_session=True)
        for rank in range(1, size)
    ]
    return ranks, init_addr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def join(rank: int, size: int, init_addr: str, ranks: list[subprocess.Popen] | None = None) -> ShardGroup:
    """This process as rank `rank` of `size` (gloo), after rendezvous at `init_addr` (host:port of rank 0's
    TCP store; empty: torchrun's environment). Blocks until every rank joined (`watch` ends a wait for a
    rank that is gone)."""
    method = f"tcp://{init_addr}" if init_addr else "env://"
    dist.init_process_group("gloo", init_method=method, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
    group = ShardGroup(rank, size, list(ranks or ()))
    return group


def watch(rank: int, ranks: list[subprocess.Popen]) -> None:
    """From now on, ends this process when its group lost a rank, loading and joining included: rank 0 when
    one of the `ranks` it started exited (the others are stopped first), another rank when the process that
    started it is gone."""
    threading.Thread(target=_watch, args=(rank, ranks), name="shard-watch", daemon=True).start()


def _watch(rank: int, ranks: list[subprocess.Popen]) -> None:
    parent = os.getppid()
    log = structlog.get_logger()
    while True:
        time.sleep(WATCH_S)
        if rank == 0:
            lost = [process for process in ranks if process.poll() is not None]
            if lost and not _stopping.is_set():
                log.error("shard_rank_lost", returncode=lost[0].returncode, action="stopping the group")
                stop(ranks)
                os._exit(1)
        elif parent != 1 and os.getppid() != parent:
            log.error("shard_leader_lost", rank=rank, action="exiting")
            os._exit(1)


def stop(ranks: list[subprocess.Popen]) -> None:
    """Stops the ranks this process started (SIGTERM, then SIGKILL after 5 s), as this process ends."""
    _stopping.set()
    for rank in ranks:
        if rank.poll() is None:
            rank.terminate()
    for rank in ranks:
        try:
            rank.wait(5)
        except subprocess.TimeoutExpired:
            rank.kill()
