"""Plugin interfaces: filters, scorers, pickers, profile handlers, data producers and hooks.

A plugin is a class registered by `type` name (see `registry.py`). The scheduler calls the
synchronous methods on the event loop, so they must be bounded CPU work with no I/O; data
producers are async and may await (off-loop tokenization, say) under a deadline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

from epp.framework.datakeys import DataKey
from epp.framework.endpoints import EndpointSource
from epp.framework.load import InflightLedger
from epp.framework.sharing import DecisionSharing
from epp.framework.types import Endpoint, InferenceRequest, ResponseInfo

if TYPE_CHECKING:  # pragma: no cover
    from prometheus_client import CollectorRegistry

    from epp.framework.params import PluginParams

T = TypeVar("T")
D = TypeVar("D")


def clamp_score(value: float) -> float:
    """Clamp a score into [0, 1]; NaN counts as 0."""
    if value != value:  # NaN
        return 0.0
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value


# `CycleState.get` key of the scheduling cycle's profile results so far (name -> result), for plugins of a
# later profile that read an earlier pick (llm-d's `peer-endpoint`: the prefill profile sees the decode pick).
PROFILE_RESULTS_STATE_KEY = "epp.framework/profile-results"


class CycleState:
    """Per-request state shared by the plugins of one scheduling cycle and the request's hooks.

    Producers publish per-endpoint data under a data key; consumers read it back. Plugins may
    also keep private per-request state under their own name.
    """

    __slots__ = ("_endpoint_data", "_plugin_state", "_request_headers")

    def __init__(self) -> None:
        self._endpoint_data: dict[str, dict[str, Any]] = {}
        self._plugin_state: dict[str, Any] = {}
        self._request_headers: dict[str, str] = {}

    def put_endpoint_data(self, key: str, endpoint: str, value: Any) -> None:
        """Publish `value` for endpoint name `endpoint` under data key `key`."""
        self._endpoint_data.setdefault(key, {})[endpoint] = value

    @overload
    def endpoint_data(self, key: DataKey[T], endpoint: str) -> T | None: ...
    @overload
    def endpoint_data(self, key: DataKey[T], endpoint: str, default: D) -> T | D: ...
    @overload
    def endpoint_data(self, key: str, endpoint: str, default: Any = None) -> Any: ...

    def endpoint_data(self, key: str, endpoint: str, default: Any = None) -> Any:
        """Read what a producer published for `endpoint` under `key` (typed by a `DataKey`)."""
        return self._endpoint_data.get(key, {}).get(endpoint, default)

    @overload
    def all_endpoint_data(self, key: DataKey[T]) -> Mapping[str, T]: ...
    @overload
    def all_endpoint_data(self, key: str) -> Mapping[str, Any]: ...

    def all_endpoint_data(self, key: str) -> Mapping[str, Any]:
        """Everything published under `key`, by endpoint name."""
        return self._endpoint_data.get(key, {})

    def put(self, plugin_name: str, value: Any) -> None:
        """Store a plugin's private per-request state."""
        self._plugin_state[plugin_name] = value

    def get(self, plugin_name: str, default: Any = None) -> Any:
        """Read a plugin's private per-request state."""
        return self._plugin_state.get(plugin_name, default)

    def set_request_header(self, name: str, value: str) -> None:
        """Add a header to the request sent upstream (pre-request hooks; replaces a client's copy)."""
        key = name.lower()
        # Pseudo-headers and framing belong to Envoy and the picker's body handling.
        if not key or key.startswith(":") or key in ("content-length", "host", "transfer-encoding"):
            raise ValueError(f"a plugin may not set the request header {name!r}")
        self._request_headers[key] = value

    def request_headers(self) -> Mapping[str, str]:
        """Headers plugins asked to set on the upstream request, by lower-case name."""
        return self._request_headers


@dataclass(frozen=True, slots=True)
class ScoredEndpoint:
    """An endpoint with its total weighted score in one profile run."""

    endpoint: Endpoint
    score: float


@dataclass(frozen=True, slots=True)
class ProfileRunResult:
    """The endpoints a profile's picker chose: primary first, then fallbacks."""

    targets: tuple[Endpoint, ...]


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    """The outcome of one scheduling cycle over all profiles."""

    profile_results: Mapping[str, ProfileRunResult | None]
    primary_profile: str

    @property
    def targets(self) -> tuple[Endpoint, ...]:
        """Targets of the primary profile (primary endpoint first)."""
        result = self.profile_results.get(self.primary_profile)
        return result.targets if result else ()


@dataclass
class PluginContext:
    """What a plugin's constructor may use: the pool's endpoints, a metrics registry, the load and the peers."""

    metrics_registry: CollectorRegistry | None = None
    # The pool's endpoints and their metrics (None: no pool, e.g. `epp check-config`).
    endpoints: EndpointSource | None = None
    # The picker's own in-flight work per endpoint, booked by the director (see epp.framework.load).
    load: InflightLedger = field(default_factory=InflightLedger)
    # The link to the other pickers of the pool (the default one has no peers).
    sharing: DecisionSharing = field(default_factory=DecisionSharing)


class Plugin:
    """Base of every plugin: a registered `type_name` and an instance `name` from the config.

    The registry builds a plugin as `cls(name, params, context)`; a plugin with parameters reads
    them from `params` in its own constructor. The optional capabilities below have defaults, so
    a plugin overrides only what it offers.
    """

    type_name: ClassVar[str] = ""

    def __init__(self, name: str | None = None, params: PluginParams | None = None,
                 context: PluginContext | None = None) -> None:
        self.name = name or self.type_name

    def consumes(self) -> frozenset[str]:
        """Data keys this plugin reads from `CycleState`; a producer must exist for each."""
        return frozenset()

    def consumes_optional(self) -> frozenset[str]:
        """Data keys read when a producer writes them: their producers run first, none is required or auto-created."""
        return frozenset()

    def default_producer_parameters(self) -> Mapping[str, Any]:
        """Parameters for the producer the loader auto-creates for what this plugin consumes (legacy configs)."""
        return {}

    def describe(self) -> str:
        """The resolved settings on one line for `epp check-config`; empty: the configured parameters."""
        return ""

    def debug_state(self) -> Mapping[str, Any]:
        """A small JSON-ready summary of this plugin's state for `GET /debug/state`; default: none.

        Sizes, capacities, counts and learned values only, never request content (prompts,
        session ids, headers). It is called on the event loop only when an operator asks, so it
        may read the plugin's structures directly, but must stay bounded: no walk over an index.
        """
        return {}

    async def start(self) -> None:
        """Start background work (called once the server runs); default: nothing."""

    async def stop(self) -> None:
        """Stop background work; default: nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class Filter(Plugin):
    """Narrows the candidate endpoints of a profile; an empty result fails the profile."""

    def filter(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> list[Endpoint]:
        raise NotImplementedError


class Scorer(Plugin):
    """Scores each endpoint in [0, 1] (values outside are clamped); higher is better."""

    def score(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> Mapping[str, float]:
        """Return a score per endpoint name; endpoints left out score 0."""
        raise NotImplementedError


class Picker(Plugin):
    """Chooses the target endpoints of a profile from the scored candidates."""

    def pick(
        self, state: CycleState, request: InferenceRequest, scored: Sequence[ScoredEndpoint]
    ) -> ProfileRunResult:
        raise NotImplementedError


class ProfileHandler(Plugin):
    """Decides which scheduling profiles run, in rounds, and which result is primary."""

    def pick_profiles(
        self,
        state: CycleState,
        request: InferenceRequest,
        profiles: Mapping[str, Any],
        results: Mapping[str, ProfileRunResult | None],
    ) -> list[str]:
        """Names of the profiles to run next; an empty list ends the cycle."""
        raise NotImplementedError

    def process_results(
        self,
        state: CycleState,
        request: InferenceRequest,
        results: Mapping[str, ProfileRunResult | None],
    ) -> SchedulingResult:
        """Turn the profile results into the cycle's result, or raise `InferenceError`."""
        raise NotImplementedError

    def check_profiles(self, names: Sequence[str]) -> None:
        """Raise `ConfigError` when the configured profile names do not suit this handler; default: any."""


class DataProducer(Plugin):
    """Computes per-request data once, before scheduling, for the plugins that consume it."""

    def produces(self) -> frozenset[str]:
        """Data keys this producer writes into `CycleState`."""
        return frozenset()

    async def prepare(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> None:
        raise NotImplementedError

    def publish_under(self, keys: Mapping[str, str]) -> bool:
        """Write each data key of `keys` under the name it maps to; False when this producer cannot (`{}` asks).

        The loader asks this of every producer of a key but one when several producers of that key
        are configured (llm-d's named producers, e.g. a GPU-tier and a CPU-tier prefix index): each
        then writes under `<key>/<its name>`, and consumers name the producer they read.
        """
        return False

    def output_key(self, key: str) -> str:
        """The name this producer writes data key `key` under (`key` itself unless `publish_under` renamed it)."""
        return key


class RequestPreprocessor(Plugin):
    """Runs once per parsed request, before admission and flow control; may return it with fields replaced.

    A session producer (`agent-identity`) reads the request's session here, publishes it in
    `CycleState` (`SESSION`) and returns the request with its fairness id set, so that flow
    control queues it under its session. Must be bounded CPU work (it runs on the event loop).
    """

    def preprocess(self, state: CycleState, request: InferenceRequest) -> InferenceRequest:
        raise NotImplementedError


class Admitter(Plugin):
    """May refuse a request before scheduling by raising `InferenceError`.

    An admitter that consumes no data keys runs before the data producers, so a refusal costs
    no tokenization; one that consumes data runs after them, right before scheduling.
    """

    def admit(
        self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> None:
        raise NotImplementedError


class PreRequestHook(Plugin):
    """Runs after the pick, before the request is sent on (record the pick, count in-flight)."""

    def pre_request(
        self, state: CycleState, request: InferenceRequest, result: SchedulingResult
    ) -> None:
        raise NotImplementedError


class FirstTokenHook(Plugin):
    """Runs once when a streamed response's first token comes back (the prefill is done).

    Not run for a whole (non-streamed) response, nor for a stream whose body the picker is not
    shown: what such a hook releases early is released by its completion hook instead.
    """

    def on_first_token(
        self, state: CycleState, request: InferenceRequest, target: Endpoint | None,
    ) -> None:
        raise NotImplementedError


class ResponseHeadersHook(Plugin):
    """Runs when the response headers arrive; may add headers through `response.set_headers`."""

    def on_response_headers(
        self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
        target: Endpoint | None,
    ) -> None:
        raise NotImplementedError


class ResponseCompleteHook(Plugin):
    """Runs once when the response ends, or when the stream dies after a pick."""

    def on_response_complete(
        self, state: CycleState, request: InferenceRequest, response: ResponseInfo,
        target: Endpoint | None,
    ) -> None:
        raise NotImplementedError


class CapacityGate(Plugin):
    """Runs before admission and scheduling, and may hold a request (bounded) until capacity exists.

    The director drops sleeping and unhealthy endpoints from the candidates first; a gate sees
    what is left and returns the candidates to schedule over (say, a replica it just woke), or
    raises `InferenceError` (503 when the capacity did not come in time).
    """

    async def ensure_capacity(
        self, state: CycleState, request: InferenceRequest, candidates: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        raise NotImplementedError


class SaturationDetector(Plugin):
    """Rates how loaded a set of endpoints is; >= 1.0 means saturated (the `saturationDetector` of a config)."""

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        raise NotImplementedError
