"""The sequences the engine serves, from submission to their end, and how each ends: released when it
finished, failed with an error, or aborted — out of the scheduler's queues, its blocks freed in the cache
service (or only forgotten), its request told."""

import structlog

from common.errors import Cancelled, PagedServeError
from gateway.kv_view import KVView
from gateway.outputs import by_request, tell
from gateway.scheduler import Scheduler
from gateway.sequence import Sequence

log = structlog.get_logger()


class LiveSeqs:
    """Engine thread only, but for `all`, which any thread may read."""

    def __init__(self, scheduler: Scheduler, kv: KVView) -> None:
        self.scheduler, self.kv = scheduler, kv
        self._by_id: dict[str, Sequence] = {}

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._by_id[seq.seq_id] = seq

    def holds(self, seq: Sequence) -> bool:
        """Whether the sequence is still served (not ended)."""
        return seq.seq_id in self._by_id

    def all(self) -> list[Sequence]:
        return list(self._by_id.values())

    def of_requests(self, group_ids: set[str]) -> list[Sequence]:
        """Every sample of those requests."""
        return [seq for seq in self._by_id.values() if seq.group_id in group_ids] if group_ids else []

    def fork(self, parent: Sequence) -> None:
        """After the prompt's prefill, samples 1..n-1 share the parent's blocks and run beside it."""
        children = parent.fork()
        self.kv.fork(parent, children)
        self.add(children)
        self.scheduler.add_running(children)

    def release(self, seqs: list[Sequence], free: bool = True) -> None:
        """Takes ended sequences out; `free`: their blocks are freed in the cache, else only forgotten."""
        for seq in seqs:
            self.scheduler.remove(seq)
            del self._by_id[seq.seq_id]
        if free:
            self.kv.release(seqs)
        else:
            self.kv.forget([seq for seq in seqs if self.kv.holds(seq)])

    def abort(self, group_ids: set[str]) -> None:
        seqs = self.of_requests(group_ids)
        if seqs:
            self.release(seqs)
            log.info("aborted", seq_ids=[s.seq_id for s in seqs])
        # NOTE: wakes the RPC thread still waiting for the request's outputs, so that it ends too.
        tell(seqs, Cancelled("the request was cancelled or its deadline passed"))

    def fail(self, seqs: list[Sequence], error: PagedServeError) -> None:
        seqs = [seq for seq in seqs if seq.seq_id in self._by_id]
        log.error("step_failed", seq_ids=[s.seq_id for s in seqs], code=error.code.name, error=str(error))
        self.release(seqs)
        tell(seqs, error)

    def fail_internal(self, seqs: list[Sequence], exc: Exception) -> None:
        """A fault of the gateway's own code in one step: its requests fail with INTERNAL, naming them."""
        log.error("step_fault", seq_ids=[s.seq_id for s in seqs], exc_info=exc)
        seqs = [seq for seq in seqs if seq.seq_id in self._by_id]
        for request_id, group in by_request(seqs).items():
            error = PagedServeError(f"{type(exc).__name__}: {exc} (request {request_id})")
            self.release(group)
            tell(group, error)
