"""GetModelInfo's reply: the model's shape and limits, and its execution plan (compute_service.plan)."""

from common.sparse_settings import SparseMode
from compute_service.lora.adapters import Adapter, Adapters
from compute_service.model_loader import ModelSpec
from compute_service.plan import ExecutionPlan
from compute_service.pooling import Pooling
from protos import common_pb2, compute_pb2


def model_info(spec: ModelSpec, adapters: Adapters | None = None) -> compute_pb2.ModelInfo:
    """The model's info, with its resident LoRA adapters (`adapters` None: LoRA off)."""
    return compute_pb2.ModelInfo(
        model=spec.name,
        num_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=spec.dtype_name,
        vocab_size=spec.vocab_size,
        max_model_len=spec.max_model_len,
        eos_token_ids=spec.eos_token_ids,
        attention_backend=spec.attention_backend,
        kv_dtype=spec.kv_dtype_name,
        kv_scales_id=spec.kv_scales.identity,
        weights=spec.weights,
        execution_plan=plan_message(spec.plan),
        sliding_windows=spec.sliding_windows,
        sparse_attention=sparse_support(spec.plan.sparse_attention),
        pooling=pooling_message(spec.pooling),
        tensor_parallel_size=spec.tensor_parallel_size,
        vision=vision_info(spec) if spec.vision else None,
        lora_adapters=[adapter_message(a) for a in adapters.by_id.values()] if adapters else [],
        lora_limits=compute_pb2.LoraLimits(
            enabled=True, max_loras=adapters.max_loras, max_lora_rank=adapters.max_rank
        )
        if adapters
        else None,
    )


def adapter_message(adapter: Adapter) -> common_pb2.LoraAdapter:
    return common_pb2.LoraAdapter(
        id=adapter.id, name=adapter.name, path=adapter.path, rank=adapter.rank, target_modules=adapter.targets
    )


def pooling_message(pooling: Pooling | None) -> compute_pb2.Pooling:
    """The model's pooling as GetModelInfo reports it (type empty: it does not pool)."""
    if pooling is None:
        return compute_pb2.Pooling()
    return compute_pb2.Pooling(
        type=pooling.mode,
        normalize=pooling.normalize,
        dimensions=pooling.dimensions,
        matryoshka=pooling.matryoshka is not None,
        matryoshka_dimensions=pooling.matryoshka or (),
        source=pooling.source,
    )


def sparse_support(mode: SparseMode | None) -> compute_pb2.SparseSupport:
    """What requests may ask of block-sparse decode under `mode` (None: nothing)."""
    if mode is None:
        return compute_pb2.SparseSupport()
    settings = mode.settings
    return compute_pb2.SparseSupport(
        enabled=True,
        default_sparse=mode.default,
        settings=compute_pb2.SparseRow(sink=settings.sink, recent=settings.recent, topk=settings.topk),
    )


def plan_message(plan: ExecutionPlan) -> compute_pb2.ExecutionPlan:
    machine = plan.machine
    return compute_pb2.ExecutionPlan(
        architecture=plan.architecture,
        device=plan.device,
        isa=f"{machine.isa} (profile {machine.profile})",
        native_kernels=machine.kernels,
        stages=[
            compute_pb2.PlanStage(stage=stage, implementation=choice.implementation, reason=choice.reason)
            for stage, choice in plan.stages().items()
        ],
    )


def vision_info(spec: ModelSpec) -> compute_pb2.VisionInfo:
    """A vision-language model's family and image token, and what sizes and keys its image store entries
    (docs/vision.md#image-store): an image's embeddings depend on the model, its dtype and weights."""
    return compute_pb2.VisionInfo(
        family=spec.vision.family,
        image_token_id=spec.vision.image_token_id,
        embedding_token_bytes=spec.vision.token_bytes,
        embedding_identity=f"{spec.vision.family}\0{spec.name}\0{spec.dtype_name}\0{spec.weights}",
    )
