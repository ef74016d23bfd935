from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoraLoadRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoraUnloadRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class LoraLimits(_message.Message):
    __slots__ = ("enabled", "max_loras", "max_lora_rank")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    max_loras: int
    max_lora_rank: int
    def __init__(self, enabled: _Optional[bool] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "dtype", "vocab_size", "max_model_len", "eos_token_ids", "attention_backend", "kv_dtype", "kv_scales_id", "weights", "execution_plan", "sliding_windows", "sparse_attention", "pooling", "lora_adapters", "lora_limits", "tensor_parallel_size", "vision")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PLAN_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_LIMITS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    attention_backend: str
    kv_dtype: str
    kv_scales_id: str
    weights: str
    execution_plan: ExecutionPlan
    sliding_windows: _containers.RepeatedScalarFieldContainer[int]
    sparse_attention: SparseSupport
    pooling: Pooling
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraAdapter]
    lora_limits: LoraLimits
    tensor_parallel_size: int
    vision: VisionInfo
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., attention_backend: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., kv_scales_id: _Optional[str] = ..., weights: _Optional[str] = ..., execution_plan: _Optional[_Union[ExecutionPlan, _Mapping]] = ..., sliding_windows: _Optional[_Iterable[int]] = ..., sparse_attention: _Optional[_Union[SparseSupport, _Mapping]] = ..., pooling: _Optional[_Union[Pooling, _Mapping]] = ..., lora_adapters: _Optional[_Iterable[_Union[_common_pb2.LoraAdapter, _Mapping]]] = ..., lora_limits: _Optional[_Union[LoraLimits, _Mapping]] = ..., tensor_parallel_size: _Optional[int] = ..., vision: _Optional[_Union[VisionInfo, _Mapping]] = ...) -> None: ...

class VisionInfo(_message.Message):
    __slots__ = ("family", "image_token_id", "embedding_token_bytes", "embedding_identity")
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    family: str
    image_token_id: int
    embedding_token_bytes: int
    embedding_identity: str
    def __init__(self, family: _Optional[str] = ..., image_token_id: _Optional[int] = ..., embedding_token_bytes: _Optional[int] = ..., embedding_identity: _Optional[str] = ...) -> None: ...

class Pooling(_message.Message):
    __slots__ = ("type", "normalize", "dimensions", "matryoshka", "matryoshka_dimensions", "source")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    type: str
    normalize: bool
    dimensions: int
    matryoshka: bool
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    source: str
    def __init__(self, type: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., matryoshka: _Optional[bool] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., source: _Optional[str] = ...) -> None: ...

class SparseSupport(_message.Message):
    __slots__ = ("enabled", "default_sparse", "settings")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SPARSE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    default_sparse: bool
    settings: SparseRow
    def __init__(self, enabled: _Optional[bool] = ..., default_sparse: _Optional[bool] = ..., settings: _Optional[_Union[SparseRow, _Mapping]] = ...) -> None: ...

class SparseRow(_message.Message):
    __slots__ = ("sink", "recent", "topk")
    SINK_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    sink: int
    recent: int
    topk: int
    def __init__(self, sink: _Optional[int] = ..., recent: _Optional[int] = ..., topk: _Optional[int] = ...) -> None: ...

class ExecutionPlan(_message.Message):
    __slots__ = ("architecture", "device", "isa", "native_kernels", "stages")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ISA_FIELD_NUMBER: _ClassVar[int]
    NATIVE_KERNELS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    device: str
    isa: str
    native_kernels: bool
    stages: _containers.RepeatedCompositeFieldContainer[PlanStage]
    def __init__(self, architecture: _Optional[str] = ..., device: _Optional[str] = ..., isa: _Optional[str] = ..., native_kernels: _Optional[bool] = ..., stages: _Optional[_Iterable[_Union[PlanStage, _Mapping]]] = ...) -> None: ...

class PlanStage(_message.Message):
    __slots__ = ("stage", "implementation", "reason")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    IMPLEMENTATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stage: str
    implementation: str
    reason: str
    def __init__(self, stage: _Optional[str] = ..., implementation: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AttachPoolResponse(_message.Message):
    __slots__ = ("epoch", "num_blocks")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    num_blocks: int
    def __init__(self, epoch: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("pool_epoch", "token_ids", "cu_seqlens_q", "num_computed", "block_tables", "block_table_width", "num_kv_groups", "sample", "sampling", "history_token_ids", "cu_history", "history_prompt_lens", "output_lens", "session_epoch", "cached_prefix", "prompt_chunk", "sparse", "constraint_rows", "constraint_bitmask", "pool", "prompt_logprobs", "prompt_target_ids", "cu_prompt_targets", "lora_ids", "images")
    POOL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLENS_Q_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CU_HISTORY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_PROMPT_LENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_ROWS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_BITMASK_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TARGET_IDS_FIELD_NUMBER: _ClassVar[int]
    CU_PROMPT_TARGETS_FIELD_NUMBER: _ClassVar[int]
    LORA_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    pool_epoch: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cu_seqlens_q: _containers.RepeatedScalarFieldContainer[int]
    num_computed: _containers.RepeatedScalarFieldContainer[int]
    block_tables: _containers.RepeatedScalarFieldContainer[int]
    block_table_width: int
    num_kv_groups: int
    sample: _containers.RepeatedScalarFieldContainer[bool]
    sampling: _containers.RepeatedCompositeFieldContainer[RowSampling]
    history_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cu_history: _containers.RepeatedScalarFieldContainer[int]
    history_prompt_lens: _containers.RepeatedScalarFieldContainer[int]
    output_lens: _containers.RepeatedScalarFieldContainer[int]
    session_epoch: int
    cached_prefix: _containers.RepeatedScalarFieldContainer[bool]
    prompt_chunk: _containers.RepeatedScalarFieldContainer[bool]
    sparse: _containers.RepeatedCompositeFieldContainer[SparseRow]
    constraint_rows: _containers.RepeatedScalarFieldContainer[int]
    constraint_bitmask: bytes
    pool: _containers.RepeatedScalarFieldContainer[bool]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[int]
    prompt_target_ids: _containers.RepeatedScalarFieldContainer[int]
    cu_prompt_targets: _containers.RepeatedScalarFieldContainer[int]
    lora_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[VisionImage]
    def __init__(self, pool_epoch: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cu_seqlens_q: _Optional[_Iterable[int]] = ..., num_computed: _Optional[_Iterable[int]] = ..., block_tables: _Optional[_Iterable[int]] = ..., block_table_width: _Optional[int] = ..., num_kv_groups: _Optional[int] = ..., sample: _Optional[_Iterable[bool]] = ..., sampling: _Optional[_Iterable[_Union[RowSampling, _Mapping]]] = ..., history_token_ids: _Optional[_Iterable[int]] = ..., cu_history: _Optional[_Iterable[int]] = ..., history_prompt_lens: _Optional[_Iterable[int]] = ..., output_lens: _Optional[_Iterable[int]] = ..., session_epoch: _Optional[int] = ..., cached_prefix: _Optional[_Iterable[bool]] = ..., prompt_chunk: _Optional[_Iterable[bool]] = ..., sparse: _Optional[_Iterable[_Union[SparseRow, _Mapping]]] = ..., constraint_rows: _Optional[_Iterable[int]] = ..., constraint_bitmask: _Optional[bytes] = ..., pool: _Optional[_Iterable[bool]] = ..., prompt_logprobs: _Optional[_Iterable[int]] = ..., prompt_target_ids: _Optional[_Iterable[int]] = ..., cu_prompt_targets: _Optional[_Iterable[int]] = ..., lora_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[VisionImage, _Mapping]]] = ...) -> None: ...

class VisionImage(_message.Message):
    __slots__ = ("row", "offset", "num_tokens", "content_hash", "tensors", "store_hit", "store_offset", "store_nbytes")
    ROW_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    STORE_HIT_FIELD_NUMBER: _ClassVar[int]
    STORE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    row: int
    offset: int
    num_tokens: int
    content_hash: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[ImageTensor]
    store_hit: bool
    store_offset: int
    store_nbytes: int
    def __init__(self, row: _Optional[int] = ..., offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., content_hash: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[ImageTensor, _Mapping]]] = ..., store_hit: _Optional[bool] = ..., store_offset: _Optional[int] = ..., store_nbytes: _Optional[int] = ...) -> None: ...

class ImageTensor(_message.Message):
    __slots__ = ("name", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RowSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "min_tokens", "suppress_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    min_tokens: int
    suppress_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., suppress_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepsRequest(_message.Message):
    __slots__ = ("first", "max_steps", "stop_token_ids", "cu_stop_token_ids", "draft_tokens", "lookup_token_ids", "cu_lookup_token_ids")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CU_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CU_LOOKUP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    first: ForwardRequest
    max_steps: _containers.RepeatedScalarFieldContainer[int]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cu_stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: int
    lookup_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cu_lookup_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first: _Optional[_Union[ForwardRequest, _Mapping]] = ..., max_steps: _Optional[_Iterable[int]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., cu_stop_token_ids: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[int] = ..., lookup_token_ids: _Optional[_Iterable[int]] = ..., cu_lookup_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "forward_ms", "top_logprobs_width", "top_token_ids", "top_logprobs", "prepare_ms", "model_ms", "attention_ms", "sample_ms", "rows", "sparse_rows", "same_step", "drafted_tokens", "accepted_tokens", "running", "pooled", "prompt_logprobs", "prompt_ranks", "prompt_top_width", "prompt_top_token_ids", "prompt_top_logprobs", "images_encoded", "image_cache_hits", "encoder_ms", "image_store_reads")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_MS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_ROWS_FIELD_NUMBER: _ClassVar[int]
    SAME_STEP_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RANKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODED_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_MS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_STORE_READS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    forward_ms: float
    top_logprobs_width: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prepare_ms: float
    model_ms: float
    attention_ms: float
    sample_ms: float
    rows: _containers.RepeatedScalarFieldContainer[int]
    sparse_rows: int
    same_step: bool
    drafted_tokens: int
    accepted_tokens: int
    running: _containers.RepeatedScalarFieldContainer[bool]
    pooled: bytes
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_ranks: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_width: int
    prompt_top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    images_encoded: int
    image_cache_hits: int
    encoder_ms: float
    image_store_reads: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., forward_ms: _Optional[float] = ..., top_logprobs_width: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prepare_ms: _Optional[float] = ..., model_ms: _Optional[float] = ..., attention_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., rows: _Optional[_Iterable[int]] = ..., sparse_rows: _Optional[int] = ..., same_step: _Optional[bool] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., running: _Optional[_Iterable[bool]] = ..., pooled: _Optional[bytes] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_ranks: _Optional[_Iterable[int]] = ..., prompt_top_width: _Optional[int] = ..., prompt_top_token_ids: _Optional[_Iterable[int]] = ..., prompt_top_logprobs: _Optional[_Iterable[float]] = ..., images_encoded: _Optional[int] = ..., image_cache_hits: _Optional[int] = ..., encoder_ms: _Optional[float] = ..., image_store_reads: _Optional[int] = ...) -> None: ...
