"""llm-d's topology-aware P/D: `topology-extractor`, `topology-affinity-filter`, `topology-affinity-scorer`.

The extractor reads each endpoint's locality from its labels, `hostname` (default
`kubernetes.io/hostname`), `rack` (`topology.kubernetes.io/rack`), `zone`
(`topology.kubernetes.io/zone`) and `region` (`topology.kubernetes.io/region`), label keys it can
be given, and publishes it per endpoint before scheduling (`TOPOLOGY`). An endpoint with none of
them has no topology. llm-d also takes a pod's `spec.hostname` when the hostname label is
missing; here endpoints carry their labels only.

The filter and the scorer run in a later profile (the `prefill` profile of a P/D handler, after
`decode` picked) and compare each candidate with that earlier pick (the peer, llm-d's
`peer-endpoint`): the tightest level both share, host, rack, zone or region, a missing value never
matching (not even empty against empty). The filter keeps candidates at `minAffinity` (host) or
tighter; with no peer topology, or when none qualifies, it keeps them all (a preference never makes
a request unroutable); a candidate without topology is dropped. The scorer gives host 1.0, rack 0.2,
zone 0.05, region 0.02, else 0 (KV transfer bandwidth: NVLink, one switch, several hops, between
sites); every candidate scores 0 without a peer topology.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epp.framework import (
    PROFILE_RESULTS_STATE_KEY,
    CycleState,
    DataKey,
    DataProducer,
    Endpoint,
    Filter,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PluginRegistry,
    ProfileRunResult,
    Scorer,
)

LEVELS = ("host", "rack", "zone", "region")
LEVEL_SCORES = {"host": 1.0, "rack": 0.2, "zone": 0.05, "region": 0.02}
DEFAULT_LABELS = {"hostname": "kubernetes.io/hostname", "rack": "topology.kubernetes.io/rack",
                  "zone": "topology.kubernetes.io/zone", "region": "topology.kubernetes.io/region"}


@dataclass(frozen=True, slots=True)
class Topology:
    """Where an endpoint runs; "" where unknown."""

    hostname: str = ""
    rack: str = ""
    zone: str = ""
    region: str = ""

    def shared_level(self, other: Topology) -> str | None:
        """The tightest level both share (a missing value never matches), or None."""
        for level, mine, theirs in (("host", self.hostname, other.hostname), ("rack", self.rack, other.rack),
                                    ("zone", self.zone, other.zone), ("region", self.region, other.region)):
            if mine and mine == theirs:
                return level
        return None


TOPOLOGY: DataKey[Topology] = DataKey("endpoint-topology")


class TopologyExtractor(DataProducer):
    """Each endpoint's host, rack, zone and region, from its labels."""

    type_name = "topology-extractor"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.labels = {field: params.str(field, default) or default for field, default in DEFAULT_LABELS.items()}

    def describe(self) -> str:
        return " ".join(f"{field}={label}" for field, label in self.labels.items())

    def produces(self) -> frozenset[str]:
        return frozenset({TOPOLOGY})

    def topology(self, ep: Endpoint) -> Topology | None:
        found = Topology(*(ep.labels.get(self.labels[f], "") for f in DEFAULT_LABELS))
        return found if any((found.hostname, found.rack, found.zone, found.region)) else None

    async def prepare(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> None:
        for ep in endpoints:
            topology = self.topology(ep)
            if topology is not None:
                state.put_endpoint_data(TOPOLOGY, ep.name, topology)


def peer_topology(state: CycleState) -> Topology | None:
    """The topology of the earlier profile's pick (the decode endpoint, for the prefill profile)."""
    results: Mapping[str, ProfileRunResult | None] = state.get(PROFILE_RESULTS_STATE_KEY) or {}
    for result in reversed(list(results.values())):
        if result is not None and result.targets:
            found: Topology | None = state.endpoint_data(TOPOLOGY, result.targets[0].name)
            return found if found is not None and any(
                (found.hostname, found.rack, found.zone, found.region)) else None
    return None


def _producer_name(params: PluginParams) -> str:
    """`topologyProducerName`: one extractor serves every reader here, so naming it changes nothing."""
    return params.str("topologyProducerName", "")


class TopologyAffinityFilter(Filter):
    """Keeps candidates sharing at least `minAffinity` with the earlier profile's pick (fails open)."""

    type_name = "topology-affinity-filter"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.min_affinity = params.str("minAffinity", "host", choices=LEVELS)
        self.producer_name = _producer_name(params)
        self._allowed = LEVELS[:LEVELS.index(self.min_affinity) + 1]

    def describe(self) -> str:
        return f"minAffinity={self.min_affinity}"

    def filter(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        peer = peer_topology(state)
        if peer is None:
            return list(endpoints)
        kept = []
        for ep in endpoints:
            mine: Topology | None = state.endpoint_data(TOPOLOGY, ep.name)
            if mine is not None and mine.shared_level(peer) in self._allowed:
                kept.append(ep)
        return kept or list(endpoints)


class TopologyAffinityScorer(Scorer):
    """host 1.0, rack 0.2, zone 0.05, region 0.02 by the level shared with the earlier profile's pick."""

    type_name = "topology-affinity-scorer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.producer_name = _producer_name(params)

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        peer = peer_topology(state)
        out: dict[str, float] = {}
        for ep in endpoints:
            mine: Topology | None = state.endpoint_data(TOPOLOGY, ep.name)
            level = mine.shared_level(peer) if mine is not None and peer is not None else None
            out[ep.name] = LEVEL_SCORES.get(level, 0.0) if level else 0.0
        return out


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group: registers the extractor, the filter and the scorer."""
    registry.register_class(TopologyExtractor)
    registry.register_class(TopologyAffinityFilter)
    registry.register_class(TopologyAffinityScorer)
