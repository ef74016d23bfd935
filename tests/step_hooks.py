"""Faults the tests inject into a gateway's steps: StepHooks (gateway/step_runner.py) that the gateway loads
with `--step-hook tests.step_hooks:NAME=ARG` (or EngineConfig.step_hook in process)."""

from common.server import REQUEST_ID_KEY
from gateway.sequence import Sequence
from protos import compute_pb2_grpc

STAGES = ("schedule", "reserve", "run", "update")


class FailStep:
    """ARG: comma-separated `[STAGE:]REQUEST_ID` (stage "run" when none is named): that stage of the steps
    holding a row of that request raises RuntimeError, where the stage's own code would fail."""

    def __init__(self, arg: str) -> None:
        self.faults: set[tuple[str, str]] = set()
        for entry in arg.split(","):
            stage, _, request_id = entry.rpartition(":")
            assert stage in ("", *STAGES), f"unknown stage {stage!r} in {entry!r}"
            self.faults.add((stage or "run", request_id))

    def stage(self, name: str, seqs: list[Sequence]) -> None:
        if any((name, seq.request_id) in self.faults for seq in seqs):
            raise RuntimeError(f"injected {name} fault (--step-hook)")

    def compute(self, stub: compute_pb2_grpc.ComputeStub) -> compute_pb2_grpc.ComputeStub:
        return stub


class BadRow:
    """ARG: a request id whose rows carry a token id compute refuses in every step sent (the gateway's own
    checks bypassed), so that compute names those rows (common.errors.RowsRefused)."""

    def __init__(self, arg: str) -> None:
        self.request_id = arg

    def stage(self, name: str, seqs: list[Sequence]) -> None:
        return None

    def compute(self, stub: compute_pb2_grpc.ComputeStub) -> "_Marking":
        return _Marking(stub, self.request_id)


class _Marking:
    """The compute stub, the first token of the marked request's rows set to -1 in each step it sends (the
    rows' request ids are the call's metadata, in row order)."""

    def __init__(self, stub: compute_pb2_grpc.ComputeStub, request_id: str) -> None:
        self._stub, self._request_id = stub, request_id

    def Forward(self, request, metadata=(), **kw):
        self._mark(request, metadata)
        return self._stub.Forward(request, metadata=metadata, **kw)

    def ForwardSteps(self, messages, metadata=(), **kw):
        first = next(messages)
        self._mark(first.first, metadata)
        return self._stub.ForwardSteps(_chain(first, messages), metadata=metadata, **kw)

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    def _mark(self, request, metadata) -> None:
        ids = [value for key, value in metadata if key == REQUEST_ID_KEY]
        rows = ids[0].split(",") if ids else []
        for row, request_id in enumerate(rows):
            if request_id == self._request_id:
                request.token_ids[request.cu_seqlens_q[row]] = -1


def _chain(first, rest):
    yield first
    yield from rest
