"""The Compute gRPC service: model info, attaching the cache service's pool, and packed forward steps."""

import argparse
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, replace
from functools import partial

import torch
from prometheus_client import Info
from transformers import AutoConfig

from common import transport
from common.devices import CPU, Device
from common.errors import FailedPrecondition, InvalidArgument, NotFound
from common.logging import configure
from common.metrics import serve_metrics
from common.options import REFUSED
from common.precision import resolve_dtype, resolve_kv_dtype
from common.server import serve
from common.session_fence import SessionFence
from common.shared_pool import dtype_from_name
from compute_service import kernels, kv_pool, scoring, shard_group, standby, tensor_parallel, vision
from compute_service.attention.registry import require_block_size
from compute_service.callers import CALLERS
from compute_service.forward_steps import ForwardSteps
from compute_service.lora import adapters as lora_adapters
from compute_service.lora.adapters import Adapters
from compute_service.lora.peft_files import AdapterError
from compute_service.model_info import adapter_message, model_info
from compute_service.model_loader import ModelSpec, load_planned, plan_for
from compute_service.options import OPTIONS
from compute_service.planning import Flags
from compute_service.pool_layout import PoolLayout, pool_layout
from compute_service.pooling import resolve as resolve_pooling
from compute_service.runner import Runner
from compute_service.step_thread import StepThread
from compute_service.stepper import Stepper
from compute_service.threads import ThreadPolicy
from protos import common_pb2, compute_pb2, compute_pb2_grpc

SERVICE_NAME = compute_pb2.DESCRIPTOR.services_by_name["Compute"].full_name
COMPUTE_INFO = Info(
    "pagedserve_compute", "The model, its dtype, weights mode, KV dtype and attention backend."
)
POOL_DIMS = 6  # [layer slots, 2, blocks, block_size, kv_heads, head_dim]
# How often compute looks whether its pool's segment still exists.
SEGMENT_CHECK_S = 1.0


class ComputeServicer(compute_pb2_grpc.ComputeServicer):
    """Holds no scheduling state: one attached pool and the model (`stepper`); steps run one at a time, all
    on `steps` (compute_service.step_thread), whichever gRPC thread serves their call."""

    def __init__(
        self,
        runner: Runner,
        spec: ModelSpec,
        log,
        device: Device = CPU,
        threads: ThreadPolicy | None = None,
        steps: StepThread | None = None,
    ) -> None:
        self.steps = steps or StepThread()
        self.device = device
        self.spec = spec
        self.log = log
        self.stepper = Stepper(runner, spec, log, threads)
        self.multi_steps = ForwardSteps(self.stepper, self.steps)

    def GetModelInfo(self, request, context) -> compute_pb2.ModelInfo:
        return model_info(self.spec, self.stepper.runner.adapters)

    def LoadLoraAdapter(self, request: compute_pb2.LoraLoadRequest, context) -> common_pb2.LoraAdapter:
        adapters = self._adapters()
        try:
            adapter = self.steps.call(adapters.load, request.name, request.path)
        except AdapterError as err:
            raise InvalidArgument(str(err)) from err
        self.log.info("lora_loaded", name=adapter.name, id=adapter.id, rank=adapter.rank, path=adapter.path)
        return adapter_message(adapter)

    def UnloadLoraAdapter(self, request: compute_pb2.LoraUnloadRequest, context) -> common_pb2.LoraAdapter:
        adapters = self._adapters()
        try:
            adapter = self.steps.call(adapters.unload, request.name)
        except KeyError as err:
            raise NotFound(f"no LoRA adapter named {request.name!r} is resident") from err
        self.log.info("lora_unloaded", name=adapter.name, id=adapter.id)
        return adapter_message(adapter)

    def _adapters(self) -> Adapters:
        adapters = self.stepper.runner.adapters
        if adapters is None:
            raise FailedPrecondition("compute serves no LoRA adapters: start it with --enable-lora")
        return adapters

    def AttachPool(self, handle: common_pb2.PoolHandle, context) -> compute_pb2.AttachPoolResponse:
        """Maps the pool only if the handle fits the model and its segment is the one the cache created for
        this handle (see common/shared_pool.py open_pool); a refusal leaves the attached pool in place."""
        if not handle.epoch:
            raise InvalidArgument("pool handle has no epoch: pass the handle CreatePool returned")
        layout = self._check_geometry(handle)
        pool = kv_pool.map_kv_pool(handle, self.device)
        num_blocks, block_size = pool.shape[2], pool.shape[3]
        try:
            require_block_size(self.spec.attention_backend, block_size)
        except ValueError as err:
            raise InvalidArgument(str(err)) from err
        fence = SessionFence.open(handle) if handle.HasField("fence") else None
        store = vision.map_store(self.stepper.runner.vision, handle)
        self.steps.call(self.stepper.attach, handle, pool, layout, fence)
        self.steps.call(vision.use_store, self.stepper.runner.vision, store)
        self.log.info(
            "pool_attached",
            epoch=handle.epoch,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_groups=layout.num_groups,
        )
        return compute_pb2.AttachPoolResponse(epoch=handle.epoch, num_blocks=num_blocks)

    def Forward(self, request: compute_pb2.ForwardRequest, context) -> compute_pb2.ForwardResponse:
        return self.steps.call(self.stepper.forward, request)

    def ForwardSteps(self, request_iterator, context) -> Iterator[compute_pb2.ForwardResponse]:
        return self.multi_steps.serve(request_iterator)

    def _check_geometry(self, handle: common_pb2.PoolHandle) -> PoolLayout:
        spec, shape = self.spec, list(handle.shape)
        if len(shape) != POOL_DIMS:
            raise InvalidArgument(
                f"pool handle has a {len(shape)}-dimensional shape {shape}: a pool is [layer slots, 2, "
                "blocks, block_size, kv_heads, head_dim]; pass the handle CreatePool returned"
            )
        layout = pool_layout(handle, spec.sliding_windows or (0,) * spec.num_layers)
        ranks = spec.tensor_parallel_size
        if (handle.shard_ranks or 1) != ranks:
            raise InvalidArgument(
                f"the pool holds {handle.shard_ranks or 1} tensor-parallel ranks' pools, this compute "
                f"service runs {ranks} ranks: create the pool with the shard_ranks GetModelInfo reports "
                "(tensor_parallel_size; a cache holding the old pool must be restarted)"
            )
        heads = spec.num_kv_heads // ranks
        expected = [layout.group_size * ranks, 2, shape[2], shape[3], heads, spec.head_dim]
        if shape != expected or min(shape) < 1 or handle.dtype != spec.kv_dtype_name:
            raise InvalidArgument(
                f"pool does not fit the model: expected shape [layer slots, 2, blocks, block_size, kv_heads, "
                f"head_dim] = {expected} and KV dtype {spec.kv_dtype_name}, got {shape} and {handle.dtype}; "
                "create the pool with the geometry and kv_dtype GetModelInfo reports"
            )
        if handle.kv_scales_id != spec.kv_scales.identity:
            raise InvalidArgument(
                f"the pool's K/V are stored with other scales (kv_scales_id {handle.kv_scales_id!r}) than "
                f"this compute service's ({spec.kv_scales.identity!r}): create the pool with the "
                "kv_scales_id GetModelInfo reports (a cache holding the old pool must be restarted)"
            )
        return layout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OPTIONS.parser(__doc__)
    args = parser.parse_args(argv)
    transport.check_listen(parser, args)
    if args.standby and not (args.socket and args.tensor_parallel_size == 1):
        parser.error("--standby takes over the unix socket of one rank: give --socket PATH, one rank")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log = configure("compute", args.log_format, args.log_level)
    threads = ThreadPolicy.from_flags(args.threads, args.single_stream_threads)
    steps = StepThread()
    steps.call(torch.set_num_threads, threads.threads)
    dtype = resolve_dtype(args.dtype, device_type=args.kv_device.type)
    kv_dtype = dtype_from_name(resolve_kv_dtype(args.kv_dtype, dtype))
    flags = Flags(
        dtype_from_name(dtype),
        args.weights,
        kv_dtype,
        args.kv_device.torch,
        args.attention_backend,
        args.plain_linear,
        fused=not args.unfused,
        max_model_len=args.max_model_len,
        sparse_attention=args.sparse_attention,
    )
    size, rank = args.tensor_parallel_size, shard_group.rank_of(args.shard_rank)
    shard = None
    if size > 1:
        flags = tensor_parallel.flags(flags)
        shard = partial(tensor_parallel.shard, rank=rank, size=size)
    ranks, init_addr = [], args.dist_init_addr
    try:
        tensor_parallel.check_flags(flags, size)
        files, plan = plan_for(args.model, flags)
        tensor_parallel.check_lora(args.enable_lora or bool(args.lora_modules), size)
        config = AutoConfig.from_pretrained(files.path)
        tensor_parallel.check(config, size)
        lora_adapters.check_flags(
            config, args.enable_lora, args.lora_modules, args.max_loras, args.max_lora_rank
        )
        tokens = args.classifier_from_token
        pooling = resolve_pooling(args.pooling, files.path, config, bool(tokens))
        score = scoring.head(files.path, config, tokens) if pooling and pooling.source == "score" else None
        if rank == 0 and size > 1 and shard_group.starts_ranks(init_addr):
            ranks, init_addr = shard_group.start(sys.argv[1:] if argv is None else argv, size, init_addr)
        if size > 1:
            shard_group.watch(rank, ranks)
        model, spec = steps.call(load_planned, files, plan, shard)
        adapters = steps.call(
            lora_adapters.from_flags,
            model,
            args.enable_lora,
            args.lora_modules,
            args.max_loras,
            args.max_lora_rank,
        )
    except (FileNotFoundError, ValueError) as exc:
        shard_group.stop(ranks)
        print(f"compute_service: {exc}", file=sys.stderr)
        raise SystemExit(REFUSED) from exc
    spec = replace(spec, tensor_parallel_size=size)
    group = steps.call(shard_group.join, rank, size, init_addr, ranks) if size > 1 else None
    if rank > 0:
        log.info("shard_rank_serving", rank=rank, size=size)
        windows = spec.sliding_windows or (0,) * spec.num_layers
        steps.call(group.serve, Runner(model, spec.kv_scales, spec.plan), windows, args.kv_device)
        return
    native = spec.plan.machine.kernels and spec.attention_backend == "cpu-native"
    log.info(
        "model_loaded",
        model=spec.name,
        dtype=spec.dtype_name,
        weights=spec.weights,
        kv_dtype=spec.kv_dtype_name,
        kv_scales_id=spec.kv_scales.identity,
        layers=spec.num_layers,
        threads=threads.threads,
        single_stream_threads=threads.single_stream,
        native_threads=steps.call(kernels.load().parallel_threads) if native else None,
        max_model_len=spec.max_model_len,
    )
    spec = replace(spec, pooling=pooling)
    if adapters is not None:
        spec = replace(spec, plan=replace(spec.plan, lora=lora_adapters.plan_choice(spec.plan)))
    if spec.vision is not None:
        model.vision.cache_images = args.encoder_cache_images
    log.info("execution_plan", **spec.plan.summary())
    log.info("pooling", **({"mode": None} if pooling is None else asdict(pooling)))
    COMPUTE_INFO.info(
        {
            "model": spec.name,
            "dtype": spec.dtype_name,
            "weights": spec.weights,
            "kv_dtype": spec.kv_dtype_name,
            "device": str(args.kv_device),
            "attention_backend": spec.attention_backend,
        }
    )
    if adapters is not None:
        log.info(
            "lora",
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            adapters=list(adapters.by_name),
        )
    runner = Runner(model, spec.kv_scales, spec.plan, pooling.mode if pooling else "", adapters, group)
    runner.score = score
    servicer = ComputeServicer(runner, spec, log, args.kv_device, threads, steps)
    try:
        standby.take_address(args.socket, args.standby, log)
    except ValueError as exc:
        print(f"compute_service: {exc}", file=sys.stderr)
        raise SystemExit(REFUSED) from exc
    serve_metrics(args.host, args.metrics_port, log)
    server = serve(
        [(compute_pb2_grpc.add_ComputeServicer_to_server, servicer, SERVICE_NAME)],
        args.host,
        args.port,
        log,
        serving=False,
        **transport.listen(args, "compute", CALLERS, log),
    )
    stop = threading.Event()
    threading.Thread(target=_watch_segment, args=(servicer, stop), name="segment-watch", daemon=True).start()
    server.handle_signals()
    server.set_serving(SERVICE_NAME, True)
    server.wait(on_stop=stop.set)
    shard_group.stop(ranks)


def _watch_segment(servicer: ComputeServicer, stop: threading.Event) -> None:
    """Drops a dead cache's pool within SEGMENT_CHECK_S even while no Forward comes."""
    while not stop.wait(SEGMENT_CHECK_S):
        servicer.stepper.drop_removed_pool()
