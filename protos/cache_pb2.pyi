from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_STATE_FREE: _ClassVar[BlockState]
    BLOCK_STATE_USED: _ClassVar[BlockState]
    BLOCK_STATE_CACHED: _ClassVar[BlockState]
    BLOCK_STATE_NULL: _ClassVar[BlockState]
BLOCK_STATE_FREE: BlockState
BLOCK_STATE_USED: BlockState
BLOCK_STATE_CACHED: BlockState
BLOCK_STATE_NULL: BlockState

class PoolGeometry(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class CreatePoolRequest(_message.Message):
    __slots__ = ("geometry", "block_size", "kv_dtype", "num_blocks", "memory_bytes", "model", "kv_scales_id", "attention_backend", "sliding_windows", "shard_ranks", "image_store")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_ID_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANKS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_STORE_FIELD_NUMBER: _ClassVar[int]
    geometry: PoolGeometry
    block_size: int
    kv_dtype: str
    num_blocks: int
    memory_bytes: int
    model: str
    kv_scales_id: str
    attention_backend: str
    sliding_windows: _containers.RepeatedScalarFieldContainer[int]
    shard_ranks: int
    image_store: bool
    def __init__(self, geometry: _Optional[_Union[PoolGeometry, _Mapping]] = ..., block_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., num_blocks: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., model: _Optional[str] = ..., kv_scales_id: _Optional[str] = ..., attention_backend: _Optional[str] = ..., sliding_windows: _Optional[_Iterable[int]] = ..., shard_ranks: _Optional[int] = ..., image_store: _Optional[bool] = ...) -> None: ...

class SequenceRequest(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "token_ids", "num_computed", "cache_salt", "max_compute_tokens", "lookahead_tokens", "lora_id", "lora_name")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed: int
    cache_salt: str
    max_compute_tokens: int
    lookahead_tokens: int
    lora_id: int
    lora_name: str
    def __init__(self, seq_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_computed: _Optional[int] = ..., cache_salt: _Optional[str] = ..., max_compute_tokens: _Optional[int] = ..., lookahead_tokens: _Optional[int] = ..., lora_id: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("new_seqs", "running_seqs", "session_id")
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    new_seqs: _containers.RepeatedCompositeFieldContainer[SequenceRequest]
    running_seqs: _containers.RepeatedCompositeFieldContainer[SequenceRequest]
    session_id: str
    def __init__(self, new_seqs: _Optional[_Iterable[_Union[SequenceRequest, _Mapping]]] = ..., running_seqs: _Optional[_Iterable[_Union[SequenceRequest, _Mapping]]] = ..., session_id: _Optional[str] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("parent_id", "child_ids", "session_id")
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    parent_id: str
    child_ids: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    def __init__(self, parent_id: _Optional[str] = ..., child_ids: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("seq_id", "block_ids", "cached_tokens", "first_block", "num_tokens", "groups")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    first_block: int
    num_tokens: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupTable]
    def __init__(self, seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., first_block: _Optional[int] = ..., num_tokens: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupTable, _Mapping]]] = ...) -> None: ...

class GroupTable(_message.Message):
    __slots__ = ("block_ids", "first_block")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("seqs", "num_computed", "session_id")
    class NumComputedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedCompositeFieldContainer[SequenceRequest]
    num_computed: _containers.ScalarMap[str, int]
    session_id: str
    def __init__(self, seqs: _Optional[_Iterable[_Union[SequenceRequest, _Mapping]]] = ..., num_computed: _Optional[_Mapping[str, int]] = ..., session_id: _Optional[str] = ...) -> None: ...

class PrefixBlocks(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("cached_tokens", "available_blocks", "prefix_blocks")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    available_blocks: int
    prefix_blocks: _containers.RepeatedCompositeFieldContainer[PrefixBlocks]
    def __init__(self, cached_tokens: _Optional[_Iterable[int]] = ..., available_blocks: _Optional[int] = ..., prefix_blocks: _Optional[_Iterable[_Union[PrefixBlocks, _Mapping]]] = ...) -> None: ...

class BlockTables(_message.Message):
    __slots__ = ("tables", "available_blocks")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    available_blocks: int
    def __init__(self, tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., available_blocks: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("seq_ids", "num_computed", "session_id", "appended_token_ids")
    class NumComputedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AppendedTokenIdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TokenIds
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    num_computed: _containers.ScalarMap[str, int]
    session_id: str
    appended_token_ids: _containers.MessageMap[str, TokenIds]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., num_computed: _Optional[_Mapping[str, int]] = ..., session_id: _Optional[str] = ..., appended_token_ids: _Optional[_Mapping[str, TokenIds]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("freed_blocks", "available_blocks")
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    freed_blocks: int
    available_blocks: int
    def __init__(self, freed_blocks: _Optional[int] = ..., available_blocks: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("total_blocks", "used_blocks", "free_blocks", "cached_blocks", "num_sequences", "block_size", "usage", "allocator", "pool_epoch", "prefix_caching", "prefix_query_tokens", "prefix_hit_tokens", "copy_on_writes", "evictions", "allocator_stats", "stored_tokens", "table_slots", "num_sessions", "kv_dtype", "device", "attention_backend", "sliding_window", "kv_groups", "kv_tier", "image_store")
    class AllocatorStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    POOL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COPY_ON_WRITES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_STATS_FIELD_NUMBER: _ClassVar[int]
    STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TABLE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_FIELD_NUMBER: _ClassVar[int]
    IMAGE_STORE_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    num_sequences: int
    block_size: int
    usage: float
    allocator: str
    pool_epoch: str
    prefix_caching: bool
    prefix_query_tokens: int
    prefix_hit_tokens: int
    copy_on_writes: int
    evictions: int
    allocator_stats: _containers.ScalarMap[str, float]
    stored_tokens: int
    table_slots: int
    num_sessions: int
    kv_dtype: str
    device: str
    attention_backend: str
    sliding_window: int
    kv_groups: _containers.RepeatedCompositeFieldContainer[KVGroupStats]
    kv_tier: TierStats
    image_store: ImageStoreStats
    def __init__(self, total_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., num_sequences: _Optional[int] = ..., block_size: _Optional[int] = ..., usage: _Optional[float] = ..., allocator: _Optional[str] = ..., pool_epoch: _Optional[str] = ..., prefix_caching: _Optional[bool] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., copy_on_writes: _Optional[int] = ..., evictions: _Optional[int] = ..., allocator_stats: _Optional[_Mapping[str, float]] = ..., stored_tokens: _Optional[int] = ..., table_slots: _Optional[int] = ..., num_sessions: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., sliding_window: _Optional[int] = ..., kv_groups: _Optional[_Iterable[_Union[KVGroupStats, _Mapping]]] = ..., kv_tier: _Optional[_Union[TierStats, _Mapping]] = ..., image_store: _Optional[_Union[ImageStoreStats, _Mapping]] = ...) -> None: ...

class ImageStoreStats(_message.Message):
    __slots__ = ("capacity_bytes", "stored_bytes", "stored_images", "leased_images", "hits", "misses", "evictions", "not_stored")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    LEASED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NOT_STORED_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    stored_bytes: int
    stored_images: int
    leased_images: int
    hits: int
    misses: int
    evictions: int
    not_stored: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., stored_images: _Optional[int] = ..., leased_images: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., not_stored: _Optional[int] = ...) -> None: ...

class ImageStoreKey(_message.Message):
    __slots__ = ("key", "nbytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    nbytes: int
    def __init__(self, key: _Optional[bytes] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ImageStoreAcquireRequest(_message.Message):
    __slots__ = ("session_id", "images")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    images: _containers.RepeatedCompositeFieldContainer[ImageStoreKey]
    def __init__(self, session_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageStoreKey, _Mapping]]] = ...) -> None: ...

class ImageStoreLease(_message.Message):
    __slots__ = ("hit", "offset", "nbytes")
    HIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    hit: bool
    offset: int
    nbytes: int
    def __init__(self, hit: _Optional[bool] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ImageStoreLeases(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[ImageStoreLease]
    def __init__(self, leases: _Optional[_Iterable[_Union[ImageStoreLease, _Mapping]]] = ...) -> None: ...

class ImageStoreRelease(_message.Message):
    __slots__ = ("key", "written")
    KEY_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    written: bool
    def __init__(self, key: _Optional[bytes] = ..., written: _Optional[bool] = ...) -> None: ...

class ImageStoreReleaseRequest(_message.Message):
    __slots__ = ("session_id", "images")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    images: _containers.RepeatedCompositeFieldContainer[ImageStoreRelease]
    def __init__(self, session_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageStoreRelease, _Mapping]]] = ...) -> None: ...

class ImageStoreReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVGroupStats(_message.Message):
    __slots__ = ("num_layers", "window", "held_blocks")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    window: int
    held_blocks: int
    def __init__(self, num_layers: _Optional[int] = ..., window: _Optional[int] = ..., held_blocks: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "location", "hit_blocks", "loaded_bytes", "load_seconds", "miss_blocks", "skipped_blocks", "corrupt_records", "written_blocks", "written_bytes", "write_drops", "errors", "queued_blocks", "stored_blocks", "stored_bytes", "budget_bytes", "evictions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_RECORDS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_DROPS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    location: str
    hit_blocks: int
    loaded_bytes: int
    load_seconds: float
    miss_blocks: int
    skipped_blocks: int
    corrupt_records: int
    written_blocks: int
    written_bytes: int
    write_drops: int
    errors: int
    queued_blocks: int
    stored_blocks: int
    stored_bytes: int
    budget_bytes: int
    evictions: int
    def __init__(self, name: _Optional[str] = ..., location: _Optional[str] = ..., hit_blocks: _Optional[int] = ..., loaded_bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ..., miss_blocks: _Optional[int] = ..., skipped_blocks: _Optional[int] = ..., corrupt_records: _Optional[int] = ..., written_blocks: _Optional[int] = ..., written_bytes: _Optional[int] = ..., write_drops: _Optional[int] = ..., errors: _Optional[int] = ..., queued_blocks: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "ttl_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_s: float
    def __init__(self, session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RenewSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "ttl_s", "num_sequences", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_s: float
    num_sequences: int
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ..., num_sequences: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("num_sequences", "freed_blocks")
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_sequences: int
    freed_blocks: int
    def __init__(self, num_sequences: _Optional[int] = ..., freed_blocks: _Optional[int] = ...) -> None: ...

class ReadBlockRequest(_message.Message):
    __slots__ = ("block_id", "layer", "include_data")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_DATA_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    layer: int
    include_data: bool
    def __init__(self, block_id: _Optional[int] = ..., layer: _Optional[int] = ..., include_data: _Optional[bool] = ...) -> None: ...

class BlockContents(_message.Message):
    __slots__ = ("block_id", "refcount", "data", "dtype", "shape")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    refcount: int
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_id: _Optional[int] = ..., refcount: _Optional[int] = ..., data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class GetBlockMapRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockMap(_message.Message):
    __slots__ = ("num_blocks", "block_size", "states", "refcounts", "pool_epoch", "image_store")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    REFCOUNTS_FIELD_NUMBER: _ClassVar[int]
    POOL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    IMAGE_STORE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    states: bytes
    refcounts: bytes
    pool_epoch: str
    image_store: ImageStoreStats
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., states: _Optional[bytes] = ..., refcounts: _Optional[bytes] = ..., pool_epoch: _Optional[str] = ..., image_store: _Optional[_Union[ImageStoreStats, _Mapping]] = ...) -> None: ...
