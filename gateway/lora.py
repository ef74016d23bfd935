"""The LoRA adapters requests may name (docs/adapters.md): compute's resident ones (ModelInfo.lora_adapters),
re-read from compute when a request names one not yet seen (an operator may load adapters at compute
directly), and loaded or unloaded through compute (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)."""

import threading
import time

import grpc
from prometheus_client.core import GaugeMetricFamily

from common.errors import FailedPrecondition, InvalidArgument, NotFound, PagedServeError, Unavailable
from common.server import channel
from protos import common_pb2, compute_pb2, compute_pb2_grpc

# compute's refusals of a load or unload, passed on as they are; any other failure is compute being away
_PASSED_ON = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
}


class LoraAdapters:
    """compute's resident adapters by name, as the engine's attached model info lists them (a new
    handshake starts over from its list)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._seen = None
        self._by_name: dict[str, common_pb2.LoraAdapter] = {}
        self._stub: compute_pb2_grpc.ComputeStub | None = None

    def listed(self) -> list[common_pb2.LoraAdapter]:
        return list(self._current().values())

    def resolve(self, name: str) -> common_pb2.LoraAdapter | None:
        """The adapter a request names (None for no name: the base model); InvalidArgument when compute
        holds none by that name (compute's list is re-read first, unless it serves no adapters)."""
        if not name:
            return None
        info = self._engine.model_info
        serving = info is not None and info.lora_limits.enabled
        adapter = self._current().get(name) or (self._reread().get(name) if serving else None)
        if adapter is None:
            loaded = ", ".join(repr(known) for known in self._current()) or "none"
            raise InvalidArgument(
                f"no LoRA adapter named {name[:200]!r} is loaded (loaded: {loaded}); GET /v1/models lists "
                "the base model and its adapters"
            )
        return adapter

    def load(self, name: str, path: str) -> common_pb2.LoraAdapter:
        """Has compute make the PEFT directory at `path` resident as `name`; its refusal passed on."""
        adapter = self._call("LoadLoraAdapter", compute_pb2.LoraLoadRequest(name=name, path=path))
        self._reread()
        return adapter

    def unload(self, name: str) -> common_pb2.LoraAdapter:
        adapter = self._call("UnloadLoraAdapter", compute_pb2.LoraUnloadRequest(name=name))
        self._reread()
        return adapter

    def _current(self) -> dict[str, common_pb2.LoraAdapter]:
        info = self._engine.model_info
        with self._lock:
            if info is not self._seen:
                self._seen = info
                self._by_name = {a.name: a for a in info.lora_adapters} if info is not None else {}
            return self._by_name

    def _reread(self) -> dict[str, common_pb2.LoraAdapter]:
        info = self._call("GetModelInfo", compute_pb2.GetModelInfoRequest())
        with self._lock:
            self._by_name = {a.name: a for a in info.lora_adapters}
            return self._by_name

    def _call(self, method: str, request):
        if self._stub is None:
            config = self._engine.config
            self._stub = compute_pb2_grpc.ComputeStub(
                channel(config.compute_target, config.internal_credentials)
            )
        try:
            return getattr(self._stub, method)(request, timeout=self._engine.config.rpc_timeout_s)
        except grpc.RpcError as err:
            error: type[PagedServeError] = _PASSED_ON.get(err.code(), Unavailable)
            raise error(f"compute: {err.details()}") from err


def requests_info(info, scheduler) -> GaugeMetricFamily:
    """vLLM's `vllm:lora_requests_info`: the time of the scrape, labelled with --max-loras and the adapters
    of the waiting and of the running sequences (names, comma-separated); no sample without LoRA."""
    family = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Scrape time (Unix seconds), labelled with the adapters of the running and waiting sequences.",
        labels=("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
    )
    if info is not None and scheduler is not None and info.lora_limits.enabled:
        waiting, running = (
            ",".join(sorted({seq.lora_name for seq in seqs if seq.lora_name}))
            for seqs in (scheduler.waiting, scheduler.running)
        )
        family.add_metric([str(info.lora_limits.max_loras), waiting, running], time.time())
    return family
