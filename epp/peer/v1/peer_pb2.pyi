from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeRequest(_message.Message):
    __slots__ = ("protocol_version", "subscriber_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    subscriber_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., subscriber_id: _Optional[str] = ...) -> None: ...

class DecisionBatch(_message.Message):
    __slots__ = ("protocol_version", "picker_id", "first_sequence", "decisions", "oldest_decision_unix_nanos")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PICKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_DECISION_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    picker_id: str
    first_sequence: int
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    oldest_decision_unix_nanos: int
    def __init__(self, protocol_version: _Optional[int] = ..., picker_id: _Optional[str] = ..., first_sequence: _Optional[int] = ..., decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., oldest_decision_unix_nanos: _Optional[int] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("prefix_routed", "booked", "released", "prefix_claimed", "prompt_tokens_counted", "endpoint_load")
    PREFIX_ROUTED_FIELD_NUMBER: _ClassVar[int]
    BOOKED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CLAIMED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COUNTED_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_LOAD_FIELD_NUMBER: _ClassVar[int]
    prefix_routed: PrefixRouted
    booked: Booked
    released: Released
    prefix_claimed: PrefixClaimed
    prompt_tokens_counted: PromptTokensCounted
    endpoint_load: EndpointLoad
    def __init__(self, prefix_routed: _Optional[_Union[PrefixRouted, _Mapping]] = ..., booked: _Optional[_Union[Booked, _Mapping]] = ..., released: _Optional[_Union[Released, _Mapping]] = ..., prefix_claimed: _Optional[_Union[PrefixClaimed, _Mapping]] = ..., prompt_tokens_counted: _Optional[_Union[PromptTokensCounted, _Mapping]] = ..., endpoint_load: _Optional[_Union[EndpointLoad, _Mapping]] = ...) -> None: ...

class PrefixRouted(_message.Message):
    __slots__ = ("endpoint", "block_hashes", "capacity")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    capacity: int
    def __init__(self, endpoint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., capacity: _Optional[int] = ...) -> None: ...

class PromptTokensCounted(_message.Message):
    __slots__ = ("characters", "tokens")
    CHARACTERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    characters: int
    tokens: int
    def __init__(self, characters: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class PrefixClaimed(_message.Message):
    __slots__ = ("endpoint", "block_keys")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, endpoint: _Optional[str] = ..., block_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class Booked(_message.Message):
    __slots__ = ("ticket", "endpoint", "uncached_tokens")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    endpoint: str
    uncached_tokens: int
    def __init__(self, ticket: _Optional[int] = ..., endpoint: _Optional[str] = ..., uncached_tokens: _Optional[int] = ...) -> None: ...

class Released(_message.Message):
    __slots__ = ("ticket", "prefill_only")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    prefill_only: bool
    def __init__(self, ticket: _Optional[int] = ..., prefill_only: _Optional[bool] = ...) -> None: ...

class EndpointLoad(_message.Message):
    __slots__ = ("endpoint", "scraped_unix_nanos", "waiting_requests", "running_requests", "kv_cache_usage", "active_models", "waiting_models", "max_active_models", "cache_block_size", "cache_num_blocks", "prefix_cache_queries", "prefix_cache_hits", "sleeping")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SCRAPED_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_MODELS_FIELD_NUMBER: _ClassVar[int]
    WAITING_MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIVE_MODELS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    scraped_unix_nanos: int
    waiting_requests: int
    running_requests: int
    kv_cache_usage: float
    active_models: _containers.RepeatedScalarFieldContainer[str]
    waiting_models: _containers.RepeatedScalarFieldContainer[str]
    max_active_models: int
    cache_block_size: int
    cache_num_blocks: int
    prefix_cache_queries: float
    prefix_cache_hits: float
    sleeping: bool
    def __init__(self, endpoint: _Optional[str] = ..., scraped_unix_nanos: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., active_models: _Optional[_Iterable[str]] = ..., waiting_models: _Optional[_Iterable[str]] = ..., max_active_models: _Optional[int] = ..., cache_block_size: _Optional[int] = ..., cache_num_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[float] = ..., prefix_cache_hits: _Optional[float] = ..., sleeping: _Optional[bool] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class PrefixSnapshot(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[PrefixRouted]
    def __init__(self, endpoints: _Optional[_Iterable[_Union[PrefixRouted, _Mapping]]] = ...) -> None: ...
