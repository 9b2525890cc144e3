"""The public plugin API of the endpoint picker.

Everything a scorer author needs is importable from here:
data types, plugin interfaces, the registry and the per-request `CycleState`.
"""

from epp.framework.errors import ConfigError, ErrorCode, InferenceError
from epp.framework.headers import PREFILLER_HOST_PORT_HEADER
from epp.framework.load import Booking, EndpointLoad, InflightLedger, estimate_prompt_tokens
from epp.framework.plugin import (
    Admitter,
    CapacityGate,
    CycleState,
    DataProducer,
    Filter,
    Picker,
    Plugin,
    PluginContext,
    PreRequestHook,
    ProfileHandler,
    ProfileRunResult,
    ResponseCompleteHook,
    ResponseHeadersHook,
    SchedulingResult,
    ScoredEndpoint,
    Scorer,
    ScorerCategory,
    clamp_score,
)
from epp.framework.registry import PluginParams, PluginRegistry, PluginSpec, default_registry, register_plugin
from epp.framework.sharing import SHARING_SERVICE, DecisionSharing, decision_sharing
from epp.framework.types import (
    ApiKind,
    Endpoint,
    EndpointMetrics,
    InferenceRequest,
    ResponseInfo,
)

__all__ = [
    "Admitter", "ApiKind", "Booking", "CapacityGate", "ConfigError", "CycleState", "DataProducer", "Endpoint",
    "EndpointLoad", "InflightLedger", "estimate_prompt_tokens",
    "EndpointMetrics", "ErrorCode", "Filter", "InferenceError", "InferenceRequest", "Picker",
    "PREFILLER_HOST_PORT_HEADER",
    "Plugin", "PluginContext", "PluginParams", "PluginRegistry", "PluginSpec", "PreRequestHook",
    "ProfileHandler", "ProfileRunResult", "ResponseCompleteHook", "ResponseHeadersHook",
    "ResponseInfo", "ScoredEndpoint", "Scorer", "ScorerCategory", "SchedulingResult",
    "clamp_score", "default_registry", "register_plugin",
    "DecisionSharing", "SHARING_SERVICE", "decision_sharing",
]
