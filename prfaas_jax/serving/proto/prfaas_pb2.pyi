from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_TIER_NONE: _ClassVar[CacheTier]
    CACHE_TIER_HOST: _ClassVar[CacheTier]
    CACHE_TIER_DISK: _ClassVar[CacheTier]
    CACHE_TIER_PEER: _ClassVar[CacheTier]
    CACHE_TIER_DECODE: _ClassVar[CacheTier]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PRFAAS_PREFILL: _ClassVar[Role]
    ROLE_PD_PREFILL: _ClassVar[Role]
    ROLE_PD_DECODE: _ClassVar[Role]
CACHE_TIER_NONE: CacheTier
CACHE_TIER_HOST: CacheTier
CACHE_TIER_DISK: CacheTier
CACHE_TIER_PEER: CacheTier
CACHE_TIER_DECODE: CacheTier
ROLE_UNSPECIFIED: Role
ROLE_PRFAAS_PREFILL: Role
ROLE_PD_PREFILL: Role
ROLE_PD_DECODE: Role

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "prompt_logprobs", "wire_precision")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WIRE_PRECISION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int
    prompt_logprobs: bool
    wire_precision: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., wire_precision: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finished", "report", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    report: RequestReport
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., report: _Optional[_Union[RequestReport, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class RequestReport(_message.Message):
    __slots__ = ("route", "prompt_len", "cached_len", "uncached_len", "threshold", "ttft_s", "state_bytes", "prefill_instance", "decode_instance", "attempts", "resumed_from", "prefill_s", "exposed_transfer_s", "decode_cached_len", "saved_bytes", "seed", "cache_tier", "wire_precision")
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    UNCACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHE_TIER_FIELD_NUMBER: _ClassVar[int]
    WIRE_PRECISION_FIELD_NUMBER: _ClassVar[int]
    route: str
    prompt_len: int
    cached_len: int
    uncached_len: int
    threshold: float
    ttft_s: float
    state_bytes: int
    prefill_instance: str
    decode_instance: str
    attempts: int
    resumed_from: int
    prefill_s: float
    exposed_transfer_s: float
    decode_cached_len: int
    saved_bytes: int
    seed: int
    cache_tier: CacheTier
    wire_precision: str
    def __init__(self, route: _Optional[str] = ..., prompt_len: _Optional[int] = ..., cached_len: _Optional[int] = ..., uncached_len: _Optional[int] = ..., threshold: _Optional[float] = ..., ttft_s: _Optional[float] = ..., state_bytes: _Optional[int] = ..., prefill_instance: _Optional[str] = ..., decode_instance: _Optional[str] = ..., attempts: _Optional[int] = ..., resumed_from: _Optional[int] = ..., prefill_s: _Optional[float] = ..., exposed_transfer_s: _Optional[float] = ..., decode_cached_len: _Optional[int] = ..., saved_bytes: _Optional[int] = ..., seed: _Optional[int] = ..., cache_tier: _Optional[_Union[CacheTier, str]] = ..., wire_precision: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouterStats(_message.Message):
    __slots__ = ("threshold", "requests_prfaas", "requests_pd", "requests_failed", "requests_in_flight", "egress_bytes", "egress_bytes_per_s", "link_capacity_bytes_per_s", "threshold_changes", "role_changes", "last_threshold_reason", "workers", "draining", "model", "vocab_size", "max_len", "prefix_moves", "prompt_tokens", "cached_tokens", "retries", "resumed", "rejected", "link_capacity_samples", "tcp_retransmitted_segments", "saved_bytes", "cache_rules", "cache_index", "lookups", "lookup_s", "router_cpu_s", "link_rtt_s", "link_data_retransmitted_segments", "decode_cache_local", "wire_narrowed", "wire_utilization")
    class DrainingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CacheRulesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class WireNarrowedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PRFAAS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PD_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    EGRESS_BYTES_FIELD_NUMBER: _ClassVar[int]
    EGRESS_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LINK_CAPACITY_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_CHANGES_FIELD_NUMBER: _ClassVar[int]
    ROLE_CHANGES_FIELD_NUMBER: _ClassVar[int]
    LAST_THRESHOLD_REASON_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_MOVES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    LINK_CAPACITY_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TCP_RETRANSMITTED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_RULES_FIELD_NUMBER: _ClassVar[int]
    CACHE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_S_FIELD_NUMBER: _ClassVar[int]
    ROUTER_CPU_S_FIELD_NUMBER: _ClassVar[int]
    LINK_RTT_S_FIELD_NUMBER: _ClassVar[int]
    LINK_DATA_RETRANSMITTED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHE_LOCAL_FIELD_NUMBER: _ClassVar[int]
    WIRE_NARROWED_FIELD_NUMBER: _ClassVar[int]
    WIRE_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    threshold: float
    requests_prfaas: int
    requests_pd: int
    requests_failed: int
    requests_in_flight: int
    egress_bytes: int
    egress_bytes_per_s: float
    link_capacity_bytes_per_s: float
    threshold_changes: int
    role_changes: int
    last_threshold_reason: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    draining: _containers.ScalarMap[str, str]
    model: str
    vocab_size: int
    max_len: int
    prefix_moves: int
    prompt_tokens: int
    cached_tokens: int
    retries: int
    resumed: int
    rejected: int
    link_capacity_samples: int
    tcp_retransmitted_segments: int
    saved_bytes: int
    cache_rules: _containers.ScalarMap[str, int]
    cache_index: CacheIndexStats
    lookups: int
    lookup_s: float
    router_cpu_s: float
    link_rtt_s: float
    link_data_retransmitted_segments: int
    decode_cache_local: int
    wire_narrowed: _containers.ScalarMap[str, int]
    wire_utilization: float
    def __init__(self, threshold: _Optional[float] = ..., requests_prfaas: _Optional[int] = ..., requests_pd: _Optional[int] = ..., requests_failed: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., egress_bytes: _Optional[int] = ..., egress_bytes_per_s: _Optional[float] = ..., link_capacity_bytes_per_s: _Optional[float] = ..., threshold_changes: _Optional[int] = ..., role_changes: _Optional[int] = ..., last_threshold_reason: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., draining: _Optional[_Mapping[str, str]] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_len: _Optional[int] = ..., prefix_moves: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., retries: _Optional[int] = ..., resumed: _Optional[int] = ..., rejected: _Optional[int] = ..., link_capacity_samples: _Optional[int] = ..., tcp_retransmitted_segments: _Optional[int] = ..., saved_bytes: _Optional[int] = ..., cache_rules: _Optional[_Mapping[str, int]] = ..., cache_index: _Optional[_Union[CacheIndexStats, _Mapping]] = ..., lookups: _Optional[int] = ..., lookup_s: _Optional[float] = ..., router_cpu_s: _Optional[float] = ..., link_rtt_s: _Optional[float] = ..., link_data_retransmitted_segments: _Optional[int] = ..., decode_cache_local: _Optional[int] = ..., wire_narrowed: _Optional[_Mapping[str, int]] = ..., wire_utilization: _Optional[float] = ...) -> None: ...

class CacheIndexStats(_message.Message):
    __slots__ = ("enabled", "instances", "current", "block_entries", "checkpoint_entries", "events", "snapshots", "answered", "asked", "overestimates")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    ASKED_FIELD_NUMBER: _ClassVar[int]
    OVERESTIMATES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    instances: int
    current: int
    block_entries: int
    checkpoint_entries: int
    events: int
    snapshots: int
    answered: int
    asked: int
    overestimates: int
    def __init__(self, enabled: _Optional[bool] = ..., instances: _Optional[int] = ..., current: _Optional[int] = ..., block_entries: _Optional[int] = ..., checkpoint_entries: _Optional[int] = ..., events: _Optional[int] = ..., snapshots: _Optional[int] = ..., answered: _Optional[int] = ..., asked: _Optional[int] = ..., overestimates: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "first_index")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    first_index: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., first_index: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("name", "role", "queue_depth", "active_slots", "max_slots", "pending_states", "completed", "egress_bytes", "link", "tokens_generated", "state_bytes_received", "prefix_cache", "data_path_pushes", "batch_calls_warming")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_STATES_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    EGRESS_BYTES_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_PUSHES_FIELD_NUMBER: _ClassVar[int]
    BATCH_CALLS_WARMING_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: Role
    queue_depth: int
    active_slots: int
    max_slots: int
    pending_states: int
    completed: int
    egress_bytes: int
    link: LinkState
    tokens_generated: int
    state_bytes_received: int
    prefix_cache: PrefixCacheStats
    data_path_pushes: int
    batch_calls_warming: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., queue_depth: _Optional[int] = ..., active_slots: _Optional[int] = ..., max_slots: _Optional[int] = ..., pending_states: _Optional[int] = ..., completed: _Optional[int] = ..., egress_bytes: _Optional[int] = ..., link: _Optional[_Union[LinkState, _Mapping]] = ..., tokens_generated: _Optional[int] = ..., state_bytes_received: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., data_path_pushes: _Optional[int] = ..., batch_calls_warming: _Optional[int] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("enabled", "block_size", "checkpoint_every", "capacity_bytes", "used_bytes", "blocks", "checkpoints", "lookups", "hits", "evictions", "prompt_tokens", "reused_tokens", "computed_tokens", "exports", "export_bytes", "imports", "import_bytes", "import_failures", "disk_capacity_bytes", "disk_used_bytes", "disk_entries", "spills", "disk_hits", "disk_dropped")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMPORTS_FIELD_NUMBER: _ClassVar[int]
    IMPORT_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMPORT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SPILLS_FIELD_NUMBER: _ClassVar[int]
    DISK_HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_DROPPED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    block_size: int
    checkpoint_every: int
    capacity_bytes: int
    used_bytes: int
    blocks: int
    checkpoints: int
    lookups: int
    hits: int
    evictions: int
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    exports: int
    export_bytes: int
    imports: int
    import_bytes: int
    import_failures: int
    disk_capacity_bytes: int
    disk_used_bytes: int
    disk_entries: int
    spills: int
    disk_hits: int
    disk_dropped: int
    def __init__(self, enabled: _Optional[bool] = ..., block_size: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., checkpoints: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., exports: _Optional[int] = ..., export_bytes: _Optional[int] = ..., imports: _Optional[int] = ..., import_bytes: _Optional[int] = ..., import_failures: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_entries: _Optional[int] = ..., spills: _Optional[int] = ..., disk_hits: _Optional[int] = ..., disk_dropped: _Optional[int] = ...) -> None: ...

class LinkState(_message.Message):
    __slots__ = ("bandwidth_bytes_per_s", "latency_s", "learned_bytes_per_s", "learned_samples", "tcp_counted", "tcp_out_segments", "tcp_retransmitted_segments", "measured_rtt_s", "rtt_samples", "data_retransmitted_segments")
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    LEARNED_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LEARNED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TCP_COUNTED_FIELD_NUMBER: _ClassVar[int]
    TCP_OUT_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TCP_RETRANSMITTED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_RTT_S_FIELD_NUMBER: _ClassVar[int]
    RTT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DATA_RETRANSMITTED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    bandwidth_bytes_per_s: float
    latency_s: float
    learned_bytes_per_s: float
    learned_samples: int
    tcp_counted: bool
    tcp_out_segments: int
    tcp_retransmitted_segments: int
    measured_rtt_s: float
    rtt_samples: int
    data_retransmitted_segments: int
    def __init__(self, bandwidth_bytes_per_s: _Optional[float] = ..., latency_s: _Optional[float] = ..., learned_bytes_per_s: _Optional[float] = ..., learned_samples: _Optional[int] = ..., tcp_counted: _Optional[bool] = ..., tcp_out_segments: _Optional[int] = ..., tcp_retransmitted_segments: _Optional[int] = ..., measured_rtt_s: _Optional[float] = ..., rtt_samples: _Optional[int] = ..., data_retransmitted_segments: _Optional[int] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: Role
    def __init__(self, role: _Optional[_Union[Role, str]] = ...) -> None: ...

class SetRoleReply(_message.Message):
    __slots__ = ("role", "switch_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    role: Role
    switch_s: float
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., switch_s: _Optional[float] = ...) -> None: ...

class SetLinkRequest(_message.Message):
    __slots__ = ("bandwidth_bytes_per_s", "latency_s")
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    bandwidth_bytes_per_s: float
    latency_s: float
    def __init__(self, bandwidth_bytes_per_s: _Optional[float] = ..., latency_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "prefix_source", "prefix_cross_cluster", "decode_cached_len", "logprobs", "wire_precision")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CROSS_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WIRE_PRECISION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    decode_address: str
    prefix_source: str
    prefix_cross_cluster: bool
    decode_cached_len: int
    logprobs: int
    wire_precision: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., prefix_source: _Optional[str] = ..., prefix_cross_cluster: _Optional[bool] = ..., decode_cached_len: _Optional[int] = ..., logprobs: _Optional[int] = ..., wire_precision: _Optional[str] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "state_bytes", "wire_bytes", "frames", "queue_s", "prefill_s", "transfer_s", "shaped", "cached_len", "prefix_bytes", "cache_seq", "logprobs", "cache_tier")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    SHAPED_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SEQ_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TIER_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    state_bytes: int
    wire_bytes: int
    frames: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    shaped: bool
    cached_len: int
    prefix_bytes: int
    cache_seq: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    cache_tier: CacheTier
    def __init__(self, first_token: _Optional[int] = ..., state_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., frames: _Optional[int] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., shaped: _Optional[bool] = ..., cached_len: _Optional[int] = ..., prefix_bytes: _Optional[int] = ..., cache_seq: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., cache_tier: _Optional[_Union[CacheTier, str]] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("request_id", "frame", "queued", "stripe", "stripes", "last", "sender", "data_ticket")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    STRIPES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    frame: bytes
    queued: bool
    stripe: int
    stripes: int
    last: bool
    sender: str
    data_ticket: bytes
    def __init__(self, request_id: _Optional[str] = ..., frame: _Optional[bytes] = ..., queued: _Optional[bool] = ..., stripe: _Optional[int] = ..., stripes: _Optional[int] = ..., last: _Optional[bool] = ..., sender: _Optional[str] = ..., data_ticket: _Optional[bytes] = ...) -> None: ...

class DataPathRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPathReply(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class KvReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvReserveReply(_message.Message):
    __slots__ = ("cached_len",)
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    cached_len: int
    def __init__(self, cached_len: _Optional[int] = ...) -> None: ...

class PushStateReply(_message.Message):
    __slots__ = ("state_bytes", "frames", "backlog_bytes", "backlog_s")
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_S_FIELD_NUMBER: _ClassVar[int]
    state_bytes: int
    frames: int
    backlog_bytes: int
    backlog_s: float
    def __init__(self, state_bytes: _Optional[int] = ..., frames: _Optional[int] = ..., backlog_bytes: _Optional[int] = ..., backlog_s: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_len", "max_new_tokens", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_len: int
    max_new_tokens: int
    logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finished", "state_bytes", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    state_bytes: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., state_bytes: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class PrefixEventsRequest(_message.Message):
    __slots__ = ("after",)
    AFTER_FIELD_NUMBER: _ClassVar[int]
    after: int
    def __init__(self, after: _Optional[int] = ...) -> None: ...

class PrefixEvent(_message.Message):
    __slots__ = ("kind", "key", "parent", "tail", "tier")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[PrefixEvent.Kind]
        BLOCK_STORED: _ClassVar[PrefixEvent.Kind]
        BLOCK_EVICTED: _ClassVar[PrefixEvent.Kind]
        CHECKPOINT_STORED: _ClassVar[PrefixEvent.Kind]
        CHECKPOINT_EVICTED: _ClassVar[PrefixEvent.Kind]
    KIND_UNSPECIFIED: PrefixEvent.Kind
    BLOCK_STORED: PrefixEvent.Kind
    BLOCK_EVICTED: PrefixEvent.Kind
    CHECKPOINT_STORED: PrefixEvent.Kind
    CHECKPOINT_EVICTED: PrefixEvent.Kind
    class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TIER_HOST: _ClassVar[PrefixEvent.Tier]
        TIER_DISK: _ClassVar[PrefixEvent.Tier]
    TIER_HOST: PrefixEvent.Tier
    TIER_DISK: PrefixEvent.Tier
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    kind: PrefixEvent.Kind
    key: bytes
    parent: bytes
    tail: _containers.RepeatedScalarFieldContainer[int]
    tier: PrefixEvent.Tier
    def __init__(self, kind: _Optional[_Union[PrefixEvent.Kind, str]] = ..., key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., tail: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[PrefixEvent.Tier, str]] = ...) -> None: ...

class PrefixEventBatch(_message.Message):
    __slots__ = ("snapshot", "last_seq", "block_size", "events")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    last_seq: int
    block_size: int
    events: _containers.RepeatedCompositeFieldContainer[PrefixEvent]
    def __init__(self, snapshot: _Optional[bool] = ..., last_seq: _Optional[int] = ..., block_size: _Optional[int] = ..., events: _Optional[_Iterable[_Union[PrefixEvent, _Mapping]]] = ...) -> None: ...

class PrefixLookupRequest(_message.Message):
    __slots__ = ("prompt_token_ids",)
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefixLookupReply(_message.Message):
    __slots__ = ("cached_len",)
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    cached_len: int
    def __init__(self, cached_len: _Optional[int] = ...) -> None: ...

class PrefixExportRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "cross_cluster")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CROSS_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cross_cluster: bool
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., cross_cluster: _Optional[bool] = ...) -> None: ...

class PrefixChunk(_message.Message):
    __slots__ = ("length", "frame")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    length: int
    frame: bytes
    def __init__(self, length: _Optional[int] = ..., frame: _Optional[bytes] = ...) -> None: ...
