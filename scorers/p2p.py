"""p2p-source-producer: llm-d's peer-to-peer KV pull hint, `x-kv-cache-source-host-port`.

Before scheduling, among the endpoints caching within one block of the most prompt tokens (only
CPU-tier tokens when the prefix producer gives tiers: pulls are served from a peer's CPU tier),
one is sampled in proportion to 1 / (1 + its waiting queue), at a point fixed by a hash of the
request id (so pulls of a widely cached prefix spread over its holders). After the pick, the
header names that peer when it holds at least `minCachedTokenDelta` more cached prompt tokens than
the computing endpoint (the prefill profile's pick when there is one, else the primary pick); the
decode pod's sidecar then asks its engine to pull those blocks instead of recomputing them. A
client's own copy of the header never passes (the picker owns it).

`p2pPortBase` names the port the peers' engines serve their P2P KV tier on for rank 0; vLLM serves
data-parallel rank r on that port + r. With it, the hint carries the source's own P2P port
(`x-kv-cache-source-p2p-port`: the base plus the source endpoint's rank, read from the
`llm-epp.io/endpoint` label InferencePool discovery sets, `<pod>-rank-<r>`; 0 without it), and
`epp engine pd-sidecar` pulls from there. Without it the sidecar's `--p2p-connector-port` (7777, the
same default) applies. One number then lives in the picker's config, where the pool is described.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.framework import (
    KV_CACHE_SOURCE_HEADER,
    KV_CACHE_SOURCE_P2P_PORT_HEADER,
    PREFIX_TIER_MATCH,
    ConfigError,
    CycleState,
    DataProducer,
    Endpoint,
    InferenceRequest,
    Plugin,
    PluginContext,
    PluginParams,
    PrefixMatchInfo,
    PreRequestHook,
    SchedulingResult,
    TierMatch,
)
from epp.scorers.prefix import prefix_source

_FNV_OFFSET, _FNV_PRIME = 0x811C9DC5, 0x01000193
# InferencePool discovery names each data-parallel rank's endpoint `<pod>-rank-<r>` under this label.
ENDPOINT_LABEL, RANK_MARK = "llm-epp.io/endpoint", "-rank-"
MAX_PORT = 65535


def spread_fraction(request_id: str) -> float:
    """A point in [0, 1) fixed by the request id (32-bit FNV-1a over its bytes)."""
    value = _FNV_OFFSET
    for byte in request_id.encode():
        value = ((value ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return value / 2**32


def endpoint_rank(endpoint: Endpoint) -> int:
    """The endpoint's data-parallel rank on its pod, from discovery's `<pod>-rank-<r>` label (0 without one)."""
    _, mark, rank = endpoint.labels.get(ENDPOINT_LABEL, "").rpartition(RANK_MARK)
    return int(rank) if mark and rank.isascii() and rank.isdigit() else 0


class P2PSourceProducer(DataProducer, PreRequestHook):
    """Names a peer holding more of the prompt's KV cache than the computing endpoint in x-kv-cache-source-host-port."""

    type_name = "p2p-source-producer"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.prefix = prefix_source(params)
        self.min_delta = params.int("minCachedTokenDelta", 1, minimum=1)
        self.prefill_profile = params.str("prefillProfileName", "prefill") or "prefill"
        self.p2p_port_base = params.int("p2pPortBase", None, minimum=1)
        if self.p2p_port_base is not None and self.p2p_port_base > MAX_PORT:
            raise ConfigError(f"plugin {name!r}: parameter 'p2pPortBase' must be a port (1-{MAX_PORT}), "
                              f"got {self.p2p_port_base}")

    def describe(self) -> str:
        source = f" prefixMatchInfoProducerName={self.prefix.name}" if self.prefix.name else ""
        port = f" p2pPortBase={self.p2p_port_base}" if self.p2p_port_base is not None else ""
        return f"minCachedTokenDelta={self.min_delta} prefillProfileName={self.prefill_profile}{port}{source}"

    def consumes(self) -> frozenset[str]:
        return frozenset({self.prefix.key})

    def consumes_optional(self) -> frozenset[str]:
        return frozenset({PREFIX_TIER_MATCH})

    def plugin_refs(self) -> Mapping[str, str]:
        """The producer `prefixMatchInfoProducerName` names (resolved by the loader)."""
        return self.prefix.refs()

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        self.prefix.bind(self.name, plugins)

    def _tokens(self, state: CycleState, endpoint: str, *, source: bool) -> tuple[int, int]:
        """(cached prompt tokens, block size) on `endpoint`; as a pull source only its CPU tier counts."""
        info: PrefixMatchInfo | None = state.endpoint_data(self.prefix.read_key, endpoint)
        if info is None:
            return 0, 0
        tiers: TierMatch | None = state.endpoint_data(self.prefix.key_of(PREFIX_TIER_MATCH), endpoint)
        if tiers is not None:
            return (tiers.cpu_tokens if source else tiers.cached_tokens), info.block_size_tokens
        return int(info.matched_blocks) * info.block_size_tokens, info.block_size_tokens

    async def prepare(self, state: CycleState, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> None:
        held = [(ep, *self._tokens(state, ep.name, source=True)) for ep in endpoints]
        held = [(ep, cached, block) for ep, cached, block in held if cached > 0]
        if not held:
            state.put(self.name, None)
            return
        most = max(cached for _, cached, _ in held)
        # Every holder within one block of the best, weighted away from queued ones.
        band = [(ep, cached, 1.0 / (1.0 + ep.metrics.waiting_queue_size))
                for ep, cached, block in held if cached + block >= most]
        point = spread_fraction(request.request_id) * sum(w for _, _, w in band)
        chosen = band[-1]
        for entry in band:
            if point < entry[2]:
                chosen = entry
                break
            point -= entry[2]
        state.put(self.name, (chosen[0], chosen[1]))

    def pre_request(self, state: CycleState, request: InferenceRequest, result: SchedulingResult) -> None:
        best: tuple[Endpoint, int] | None = state.get(self.name)
        if best is None:
            return
        computing = result.profile_results.get(self.prefill_profile)
        if computing is None or not computing.targets:
            computing = result.profile_results.get(result.primary_profile)
        if computing is None or not computing.targets:
            return
        target = computing.targets[0]
        source, cached = best
        if source.hostport == target.hostport:
            return
        if cached - self._tokens(state, target.name, source=False)[0] < self.min_delta:
            return
        state.set_request_header(KV_CACHE_SOURCE_HEADER, source.hostport)
        if self.p2p_port_base is not None:
            port = self.p2p_port_base + endpoint_rank(source)
            if port <= MAX_PORT:  # a rank past the last port is no port: the sidecar's own applies
                state.set_request_header(KV_CACHE_SOURCE_P2P_PORT_HEADER, str(port))
