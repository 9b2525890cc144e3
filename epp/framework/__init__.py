"""The public plugin API of the endpoint picker.

Everything a plugin author needs is importable from here: data types, plugin interfaces and
their optional capabilities, parameters, the registry, the per-request `CycleState` and the
typed data keys producers publish in it, the in-flight ledger, the pool's endpoints and the
helpers plugins share (durations, metrics, prompt size, rendezvous homes), and the request parsers
(one per API format) with the JSON helpers they share. The built-in plugins
import nothing else of `epp` (an import-linter contract in pyproject.toml).
"""

from epp.framework.datakeys import (
    INFLIGHT_LOAD,
    PREFIX_CACHE_FREE_BLOCKS,
    PREFIX_HOME,
    PREFIX_MATCH_INFO,
    PREFIX_TIER_MATCH,
    PROMPT_TOKENS,
    SESSION,
    DataKey,
    InflightLoad,
    PrefixMatchInfo,
    PromptTokens,
    SessionKey,
    TierMatch,
)
from epp.framework.durations import parse_duration
from epp.framework.endpoints import EndpointListener, EndpointSource
from epp.framework.errors import DROP_REASON_HEADER, ConfigError, DropReason, ErrorCode, InferenceError
from epp.framework.headers import (
    ENCODER_HOSTS_PORTS_HEADER,
    FAIRNESS_ID_HEADERS,
    KV_CACHE_SOURCE_HEADER,
    KV_CACHE_SOURCE_P2P_PORT_HEADER,
    PREFILLER_HOST_PORT_HEADER,
)
from epp.framework.jsonbody import (
    MAX_RESPONSE_JSON_DEPTH,
    UnreadableResponse,
    decode_json_object,
    has_lone_surrogate,
    nesting_exceeds,
    read_json,
    read_json_or_none,
)
from epp.framework.load import (
    NO_LOAD,
    Booking,
    EndpointLoad,
    InflightLedger,
    body_prompt_characters,
    estimate_prompt_tokens,
    prompt_characters,
)
from epp.framework.metrics import once_per_registry
from epp.framework.params import PluginParams
from epp.framework.parsing import (
    DEFAULT_PARSER_TYPES,
    ParsedBody,
    ParseLimits,
    Parser,
    compact_json,
    go_json,
    json_array_prefix,
    media_digest,
    session_name,
    shorten_strings,
)
from epp.framework.plugin import (
    PROFILE_RESULTS_STATE_KEY,
    Admitter,
    CapacityGate,
    CycleState,
    DataProducer,
    Filter,
    FirstTokenHook,
    Picker,
    Plugin,
    PluginContext,
    PreRequestHook,
    ProfileHandler,
    ProfileRunResult,
    RequestPreprocessor,
    ResponseCompleteHook,
    ResponseHeadersHook,
    SaturationDetector,
    SchedulingResult,
    ScoredEndpoint,
    Scorer,
    clamp_score,
)
from epp.framework.registry import PluginRegistry, PluginSpec, default_registry
from epp.framework.rendezvous import publish_home
from epp.framework.sharing import DecisionSharing
from epp.framework.types import (
    Endpoint,
    EndpointMetrics,
    InferenceRequest,
    MediaItem,
    RenderRequest,
    RequestFormat,
    ResponseInfo,
    openai_error_body,
)

__all__ = [
    "Admitter", "Booking", "CapacityGate", "ConfigError", "CycleState", "DROP_REASON_HEADER", "DataKey",
    "DataProducer", "DecisionSharing", "DropReason", "ENCODER_HOSTS_PORTS_HEADER", "Endpoint", "EndpointListener",
    "EndpointLoad", "EndpointMetrics", "EndpointSource",
    "ErrorCode", "FAIRNESS_ID_HEADERS", "Filter", "FirstTokenHook", "INFLIGHT_LOAD", "InferenceError",
    "InferenceRequest", "InflightLedger", "InflightLoad", "KV_CACHE_SOURCE_HEADER",
    "KV_CACHE_SOURCE_P2P_PORT_HEADER",
    "NO_LOAD", "PREFILLER_HOST_PORT_HEADER", "PREFIX_CACHE_FREE_BLOCKS", "PREFIX_HOME", "PREFIX_MATCH_INFO",
    "PREFIX_TIER_MATCH", "PROMPT_TOKENS", "Picker", "Plugin", "PluginContext", "PluginParams", "PluginRegistry", "PluginSpec",
    "PreRequestHook", "PrefixMatchInfo", "PromptTokens", "ProfileHandler", "ProfileRunResult", "RequestPreprocessor",
    "ResponseCompleteHook",
    "ResponseHeadersHook", "ResponseInfo", "SESSION", "SaturationDetector", "SchedulingResult", "ScoredEndpoint", "Scorer",
    "SessionKey", "TierMatch", "clamp_score", "default_registry", "estimate_prompt_tokens", "once_per_registry", "parse_duration",
    "prompt_characters", "publish_home",
    "PROFILE_RESULTS_STATE_KEY",
    # Request parsers (epp.framework.parsing) and the JSON helpers they share.
    "DEFAULT_PARSER_TYPES", "MAX_RESPONSE_JSON_DEPTH", "MediaItem", "ParseLimits", "ParsedBody", "Parser",
    "RenderRequest", "RequestFormat",
    "UnreadableResponse", "body_prompt_characters", "compact_json", "decode_json_object", "go_json",
    "has_lone_surrogate", "json_array_prefix", "media_digest", "nesting_exceeds", "openai_error_body", "read_json",
    "read_json_or_none", "session_name", "shorten_strings",
]
