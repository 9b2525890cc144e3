"""llm-d router plugin types: what each maps to here, the deprecated names, and those refused.

Facts from llm-d-router's registered plugins (`cmd/epp/runner/runner.go`) and their READMEs. A
type of `LLMD_TYPES` loads with llm-d's meaning (the `differences` say where ours is not the
same); a type of `REFUSED_TYPES` fails with its reason instead of "unknown plugin type";
`ALIASES` are llm-d's deprecated names, loaded as the current type with a note. `epp check-config`
prints the mapping line of every llm-d type a config uses; docs/llm-d-compatibility.md is the
same table for people.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LlmdType:
    """How one llm-d plugin type is served here."""

    meaning: str  # what it does (here and in llm-d)
    differences: str = ""  # where ours differs from llm-d's meaning


LLMD_TYPES: Mapping[str, LlmdType] = {
    # Data producers
    "approx-prefix-cache-producer": LlmdType(
        "hashes the prompt into blocks, matches them against what each endpoint was sent, records the pick",
        "defaults are GIE's (maxPrefixBlocksToMatch 256, maxPrefixTokensToMatch 0) where llm-d's are 2048 and "
        "131072; characters per token are learned from responses (charsPerToken: 4 gives llm-d's fixed 4) and "
        "a chain's tail is evicted first (chainAware: false gives llm-d's LRU); gie-approx-prefix-cache-producer "
        "is the unmodified algorithm"),
    "precise-prefix-cache-producer": LlmdType(
        "prefix match per endpoint from the replicas' vLLM KV events (GPU, CPU and disk tiers)",
        "one KV-event subscription per pool endpoint (not per pod label); the index counts entries, not "
        "bytes; matched blocks are weighted by tier (kvCacheBackendConfigs -> tierWeights); tokens only from a "
        "token-producer with real tokens (vllm or local backend) or our `tokenizers`"),
    "token-producer": LlmdType(
        "the prompt's token ids, for the precise producer and context-length-aware",
        "backends: vllm (render API, or /tokenize where vLLM refuses it), local (our tokenizer files, "
        "`tokenizers`) and estimate; the data producers of a request have 400 ms in all here, so a slower "
        "render leaves it without tokens; vllm.endpointDiscovery, messagesRenderMode other than auto and the "
        "estimate backend's multimodal settings are refused"),
    "inflight-load-producer": LlmdType(
        "requests and uncached prompt tokens (plus estimated output with addEstimatedOutputTokens) this picker has "
        "in flight per endpoint; prompt tokens released at a stream's first token",
        "prompt tokens from a token-producer when one is configured, else characters / 4 (llm-d auto-creates a "
        "token-producer); syncCrossReplicaState has no effect (each picker counts its own); requestTimeout (ours) "
        "bounds how long an unanswered request counts"),
    "mm-embeddings-cache-producer": LlmdType(
        "per endpoint, the multimodal items (images, videos, audio) of the requests sent there, an LRU of "
        "cacheSizeInMBPerServer / 2 MiB entries; each candidate's matched and total items",
        "items are identified by their content as the request's parser reads it (llm-d reads the renderer's "
        "multimodal hashes when a token-producer gives them)"),
    "mm-embeddings-cache-scorer": LlmdType("matched / total multimodal items of the request (0 without media)"),
    "dcgm-data-source": LlmdType(
        "scrapes the DCGM Exporter beside each endpoint (scheme, port 9400, path, interval, insecureSkipVerify) for "
        "its dcgm-extractor",
        "useNodeAddress: true (a DaemonSet exporter on the node) is refused: endpoints know neither their node nor "
        "their pod name"),
    "dcgm-extractor": LlmdType("GPUUtilization: the endpoint's highest DCGM_FI_DEV_GPU_UTIL, as a fraction"),
    "endpoint-attribute-filter": LlmdType(
        "keeps endpoints whose attribute passes algorithm.threshold (operator, value); onMissing, fallbackOnEmpty",
        "producer is required (the core metrics extractor's custom metrics, llm-d's default, are not read)"),
    "endpoint-attribute-scorer": LlmdType(
        "linear score of an attribute (lower or higher is better) over fixedRange or the candidates' range",
        "producer is required (the core metrics extractor's custom metrics, llm-d's default, are not read)"),
    "topology-extractor": LlmdType(
        "each endpoint's host, rack, zone and region from its labels (hostname, rack, zone, region: the label keys)",
        "a pod's spec.hostname is not read (endpoints carry their labels only)"),
    "topology-affinity-filter": LlmdType(
        "keeps candidates sharing minAffinity (host, rack, zone, region) or tighter with the earlier profile's pick "
        "(the decode endpoint); no peer topology or no candidate left: all kept",
        "topologyProducerName is checked as a string: one extractor serves every reader"),
    "topology-affinity-scorer": LlmdType(
        "host 1.0, rack 0.2, zone 0.05, region 0.02 by the level shared with the earlier profile's pick",
        "topologyProducerName is checked as a string: one extractor serves every reader"),
    # Scorers
    "prefix-cache-scorer": LlmdType(
        "(1 - matchLengthWeight) x matched/total blocks + matchLengthWeight x min(1, matched tokens / "
        "matchLengthScaleTokens)^2",
        "a lone prefix producer, whatever its name, serves every consumer (llm-d would auto-create an approximate "
        "producer beside a precise one); with several, each scorer reads the one it names and one naming none "
        "the producer named approx-prefix-cache-producer, auto-created when absent, as in llm-d"),
    "precise-prefix-cache-scorer": LlmdType(
        "deprecated wrapper: loaded as a precise-prefix-cache-producer plus a prefix-cache-scorer reading it"),
    "queue-scorer": LlmdType("shorter waiting queue scores higher (min-max over the candidates)",
                             "the queue includes this picker's requests sent since the last scrape "
                             "(useInflight: false: the scrape only)"),
    "kv-cache-utilization-scorer": LlmdType("1 - KV-cache usage",
                                            "usage includes this picker's requests in prefill (useInflight: false: "
                                            "the scrape only)"),
    "running-requests-size-scorer": LlmdType("fewer running requests scores higher (min-max)"),
    "lora-affinity-scorer": LlmdType("1 for an active adapter, 0.8 with a free slot, 0.6 waiting, else 0"),
    "token-load-scorer": LlmdType("1 - min(1, (in-flight tokens + the request's own uncached tokens) / "
                                  "queueThresholdTokens)"),
    "load-aware-scorer": LlmdType("0.5 on an empty queue, falling linearly to 0 at `threshold` waiting requests",
                                  "the queue includes this picker's requests sent since the last scrape"),
    "active-request-scorer": LlmdType(
        "1 at or under idleThreshold requests in flight, else (max - n) / max x maxBusyScore",
        "requestTimeout (ignored by llm-d) bounds how long a request without an answer counts"),
    "no-hit-lru-scorer": LlmdType("a request no endpoint holds goes to the least recently cold-picked endpoint",
                                  "prefixPluginType and prefixPluginName have no effect: the match info is read "
                                  "from the prefix producer (prefixMatchInfoProducerName)"),
    "session-affinity-filter": LlmdType(
        "only the endpoint the session names when it is a candidate (x-session-token, or a session id's last "
        "pick), else all",
        "not gated behind --allow-experimental-plugins (alpha in llm-d); the token is base64 of the endpoint's "
        "ip:port (llm-d's: of the pod's namespace/name); attribute sources: agent-identity only (the session the "
        "session producer found)"),
    "utilization-filter": LlmdType(
        "keeps the endpoints within every cap of conditions (active-requests in flight, scraped running-requests, "
        "waiting-queue, kv-cache-utilization); none kept: all with fallbackOnEmpty",
        "not gated behind --allow-experimental-plugins (alpha in llm-d)"),
    "header-profile-handler": LlmdType(
        "runs the one profile the headerName header (EPP-Profile) names, defaultProfile (decode) without one",
        "a header naming no profile is answered 400 (llm-d answers 429); not gated behind "
        "--allow-experimental-plugins (alpha in llm-d)"),
    "session-affinity-scorer": LlmdType(
        "1 for the endpoint the session names (x-session-token, or a session id's last pick), else 0",
        "not gated behind --allow-experimental-plugins (alpha in llm-d); the token is base64 of the endpoint's "
        "ip:port; attribute sources: agent-identity only (the session the session producer found)"),
    "context-length-aware": LlmdType(
        "prefers (or, with enableFiltering, keeps only) endpoints whose context-length range label fits the prompt",
        "reusableTokensProducerName (P2P cache subtraction) is refused"),
    # Filters
    "prefix-cache-affinity-filter": LlmdType(
        "keeps the endpoints holding >= affinityThreshold of the prompt (all when none does, or on exploration) "
        "unless the best of them trails the best other endpoint by more than maxTTFTPenaltyMs of estimated TTFT "
        "(in-flight tokens / peakPrefillThroughput) or maxTokensInFlightPenalty in-flight tokens",
        "ttftSource: latencyPredictor reads this picker's own self-calibrating predicted TTFT (predicted-ttft-"
        "scorer's model), not llm-d's latency-predictor sidecar; latencyPredictionInfoProducerName is refused; "
        "maxTokensInFlightPenalty follows llm-d's tests of it (min sticky minus min other in-flight tokens)"),
    "label-selector-filter": LlmdType("keeps endpoints matching matchLabels and matchExpressions"),
    "by-label-selector": LlmdType("deprecated name of label-selector-filter"),
    "by-label": LlmdType("keeps endpoints whose label has one of validValues (label-less with allowsNoLabel)"),
    "decode-filter": LlmdType("keeps endpoints whose llm-d.ai/role includes decode (or `both`), and unlabelled ones"),
    "prefill-filter": LlmdType("keeps endpoints whose llm-d.ai/role includes prefill (or `both`)"),
    "encode-filter": LlmdType("keeps endpoints whose llm-d.ai/role includes encode"),
    "header-based-testing-filter": LlmdType("keeps the endpoints named in test-epp-endpoint-selection"),
    # Pickers
    "max-score-picker": LlmdType(
        "the highest total score; maxNumOfEndpoints targets",
        "ties go to the endpoint whose prefix cache has most room, then at random (tieBreak: random is llm-d's)"),
    "random-picker": LlmdType("uniformly random targets"),
    "weighted-random-picker": LlmdType("random in proportion to score (A-Res)"),
    # Profile handlers and deciders
    "single-profile-handler": LlmdType("runs the one profile"),
    "disagg-profile-handler": LlmdType(
        "runs decode, then encode and prefill when their deciders approve; names the encode picks in "
        "x-encoder-hosts-ports and the prefill pick in x-prefiller-host-port",
        "stageOrder prefill-first is refused"),
    "always-disagg-multimodal-decider": LlmdType("runs the encode stage for requests with image, audio or video "
                                                 "content blocks"),
    "disagg-headers-handler": LlmdType(
        "deprecated in llm-d (use disagg-profile-handler, which sets these headers itself): names the prefill "
        "pick in x-prefiller-host-port and the encode picks in x-encoder-hosts-ports"),
    "p2p-source-producer": LlmdType(
        "names in x-kv-cache-source-host-port a peer caching at least minCachedTokenDelta more prompt tokens "
        "than the computing endpoint (sampled within one block of the best, away from queued peers)",
        "not gated behind --allow-experimental-plugins (alpha in llm-d); the pull itself is the sidecar's "
        "(epp engine pd-sidecar adds kv_transfer_params.remote_kv_source) and the engine's P2P connector; "
        "p2pPortBase (not a field of llm-d's released producer) sends the source's P2P port, base + its "
        "data-parallel rank, in x-kv-cache-source-p2p-port for the sidecar"),
    "prefix-based-pd-decider": LlmdType(
        "disaggregate when the decode pick's uncached prompt is at least nonCachedTokens (0: never)",
        "with precise KV events the cached tokens are exact (any tier) rather than matched blocks x block size"),
    "always-disagg-pd-decider": LlmdType("disaggregate every request"),
    "pd-profile-handler": LlmdType(
        "deprecated in llm-d; here our own P/D handler (threshold, decodeProfile, prefillProfile)",
        "llm-d's deciderPluginName, primaryPort and prefixMatchInfoProducerName are refused: use "
        "disagg-profile-handler"),
    "data-parallel-profile-handler": LlmdType(
        "sends the request to the picked pod's primaryPort with the picked rank in x-data-parallel-host-port",
        "as in llm-d, hooks that record the pick see the primary port; per-rank endpoints (InferencePool "
        "targetPorts) need no handler"),
    "prefill-header-handler": LlmdType("names the prefill pick in x-prefiller-host-port (deprecated in llm-d)"),
    # Saturation, flow control
    "probabilistic-admitter": LlmdType(
        "sheds a sheddable request (priority < 0) with probability min(saturation^power x k, 1), saturation the mean "
        "of max(queue/queueDepthThreshold, kv/kvCacheUtilThreshold)"),
    "disaggregatedset-rollout-screener": LlmdType(
        "keeps one DisaggregatedSet revision with a Ready endpoint of every required role per request (weighted "
        "max-role or sum), for every profile; strict header selectors screen, all stamp the served label",
        "it runs as a capacity gate (before admission); revisions come from the pool's endpoints' labels; "
        "requiredRoles: [..] is read like requireRoles: {values: [..]}"),
    "utilization-detector": LlmdType("mean over endpoints of max(queue/5, kv/0.8); >= 1 is saturated"),
    "fcfs-ordering-policy": LlmdType("first come, first served within a flow"),
    "edf-ordering-policy": LlmdType("earliest deadline first within a flow"),
    "slo-deadline-ordering-policy": LlmdType(
        "orders a flow by the requests' TTFT objectives (`x-llm-d-slo-ttft-ms`)",
        "shortest predicted prefill first, a TTFT objective's latest start, bounded by agingWindow; it can shed "
        "a request that can no longer meet its objective (docs/slo-dispatch.md)"),
    "global-strict-fairness-policy": LlmdType("one queue for every flow of a band"),
    "round-robin-fairness-policy": LlmdType(
        "flows of a band take turns, one request each",
        "the turn order is the order flows became non-empty, not their ids sorted"),
    "static-usage-limit-policy": LlmdType("a fixed saturation ceiling per band"),
    "priority-holdback-policy": LlmdType(
        "stepped ceilings per priority, maxCeiling for the highest band down to minCeiling for the lowest "
        "(domain rank or value)",
        "the priorities are the configured bands and those requests used so far"),
    "soft-reflective-ceiling-policy": LlmdType(
        "band i of N: ceiling 1 - i x saturation / (N - 1); past it a band alternates open and closed, open one "
        "call in round(saturation / (1 - saturation))",
        "the priorities are the configured bands and those requests used so far"),
    "program-aware-fairness": LlmdType(
        "least attained service across programs (fairness ids): lasWeightService x (1 - service) + "
        "lasWeightHeadWait x head wait, service decayed by lasHalfLifeSeconds; strategy turn-priority: the "
        "deepest session first, turn + turnPriorityTimeWeight x head wait",
        "lasDecayFactor (llm-d's older per-dispatch decay) is taken; with las a head that waited agingWindow "
        "(60s) goes first; a turn's cached prefix is not charged (cachedTokenWeight: 1 gives llm-d's charge); "
        "turn-priority's inactivity gap runs to the head's arrival and restarts the session's count; drr and rr "
        "are refused; program state is capped at maxPrograms (docs/agentic.md)"),
    "concurrency-detector": LlmdType(
        "saturation = in-flight requests (or tokens, or hybrid) over maxConcurrency x endpoints; as a filter "
        "keeps endpoints under the limit x (1 + headroom)",
        "tokens are the prompt's; the counts are its own (inFlightLoadProducerName is checked, not read)"),
    "agent-identity": LlmdType(
        "the agent session from x-claude-code-session-id, x-session-affinity, session-id, session_id (after "
        "additionalSessionHeaders) becomes the fairness id unless the client sent one",
        "x-session-id and the body's session (prompt_cache_key, user, metadata.user_id) are read too; a sub-agent's "
        "parentSessionHeader puts it in its parent's program; the session is published for routing (SESSION)"),
    # Data layer, parsers, test plugins
    "metrics-data-source": LlmdType("where endpoints' metrics are scraped: scheme, path, TLS, interval"),
    "core-metrics-extractor": LlmdType("reads vLLM's queue, running, KV-cache, LoRA and cache-config series",
                                       "vLLM series only: engineConfigs and engineLabelKey are refused"),
    "endpoint-notification-source": LlmdType("endpoint add/remove events to producers",
                                             "always on: producers follow the pool's endpoints"),
    "openai-parser": LlmdType("OpenAI completions, chat, responses, conversations and embeddings by path; "
                              "vLLM's rerank too",
                              "Responses previous_response_id follow-ups go to the replica that stored the response "
                              "(our responseAffinityCapacity, responseAffinityTTL)"),
    "anthropic-parser": LlmdType("Anthropic Messages (/v1/messages) and /v1/messages/count_tokens: system, "
                                 "messages of content blocks"),
    "vllmhttp-parser": LlmdType("vLLM's /inference/v1/generate (token ids, multimodal features), then every "
                                "openai-parser path"),
    "sglanghttp-parser": LlmdType("SGLang's /generate (input_ids or text, extra_key, image_data)",
                                  "text prompts and image_data are read too (llm-d: input_ids only)"),
    "passthrough-parser": LlmdType("the fallback: requests on paths no parser claims go on unread, routed by "
                                   "load",
                                   "added last to a chain without a fallback"),
    "destination-endpoint-served-verifier": LlmdType("echoes the served endpoint in x-conformance-test-served-endpoint"),
}

# llm-d types whose factory never reads its `parameters` (llm-d accepts and ignores any given): here
# the parameters our plugin does not take are ignored too, each listed in a note.
PARAMETERLESS_TYPES = frozenset({
    "queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer", "running-requests-size-scorer",
    "single-profile-handler", "decode-filter", "prefill-filter", "encode-filter", "always-disagg-pd-decider",
    "always-disagg-multimodal-decider", "openai-parser", "anthropic-parser", "passthrough-parser", "vllmhttp-parser",
    "vllmgrpc-parser", "sglanghttp-parser", "vertexai-parser", "fcfs-ordering-policy", "edf-ordering-policy",
    "global-strict-fairness-policy", "round-robin-fairness-policy", "slo-deadline-ordering-policy",
    "priority-then-time-eviction-order-policy", "sheddable-eviction-filter", "header-based-testing-filter",
    "destination-endpoint-served-verifier", "endpoint-notification-source", "models-data-extractor",
    "dcgm-extractor", "local-syncer",
})

# llm-d's deprecated names: loaded as the current type, with a note.
ALIASES: Mapping[str, str] = {
    "by-label-selector": "label-selector-filter",
    "tokenizer": "token-producer",
}

_PREDICTED = "predicted-ttft-scorer weighs queue wait against uncached prefill, with costs learned online"
_MULTICLUSTER = ("multi-cluster routing (a hub picker sending requests to other clusters' gateways by their pickers' "
                 "pool-average metrics) is not supported; run a picker in each cluster for its own pool")
REFUSED_TYPES: Mapping[str, str] = {
    "multicluster-session-affinity-filter": _MULTICLUSTER,
    "header-label-affinity-scorer": "alpha in llm-d, not implemented",
    "session-id-producer": "session-affinity-scorer reads the session id header itself",
    "multicluster-approx-prefix-cache-producer": _MULTICLUSTER,
    "multicluster-queue-scorer": _MULTICLUSTER,
    "multicluster-kv-cache-utilization-scorer": _MULTICLUSTER,
    "multicluster-prefix-cache-scorer": _MULTICLUSTER,
    "multicluster-metrics-data-source": _MULTICLUSTER,
    "multicluster-metrics-extractor": _MULTICLUSTER,
    "multicluster-file-discovery": _MULTICLUSTER,
    "models-data-source": "the served models are read from the replicas by the fleet plugins (served-model-filter)",
    "models-data-extractor": "the served models are read from the replicas by the fleet plugins (served-model-filter)",
    "k8s-notification-source": "watches Kubernetes objects for extractors, and no extractor here reads any; the "
                               "pool's pods are watched by inference-pool-discovery (--pool-name)",
    "request-attribute-reporter": "not implemented (CEL over usage into dynamic metadata)",
    "vllmgrpc-parser": "gRPC request bodies are not read (HTTP/JSON APIs only); use vllmhttp-parser",
    "vertexai-parser": "Vertex AI's gRPC PredictionService is not read; use openai-parser for its OpenAI-compatible "
                       "chat completions",
    "sheddable-eviction-filter": "built into flow control: flowControl.enableEviction evicts sheddable requests",
    "priority-then-time-eviction-order-policy": "built into flow control: flowControl.enableEviction evicts the lowest "
                                                "priority, newest dispatch first",
}


# Plugin types that appear in configs but are not llm-d router plugins (experimental images, other
# projects' forks, names that were never released), each refused with what to use instead.
REFUSED_OTHER_TYPES: Mapping[str, str] = {
    "latency-observer-producer-hub": "a multi-cluster hub plugin (llm-d v0.11); " + _MULTICLUSTER,
    "latency-observation-scorer-hub": "a multi-cluster hub plugin (llm-d v0.11); " + _MULTICLUSTER,
    "lmetric-scorer": "not an llm-d router plugin (an experimental build); predicted-ttft-scorer ranks endpoints by "
                      "predicted TTFT from the prefix match and in-flight load",
    "slo-request-tracker": "an experimental build's plugin (before llm-d's latency plugins); use latency-scorer "
                           "(served here by predicted-ttft-scorer)",
    "slo-scorer": "an experimental build's plugin (before llm-d's latency plugins); use latency-scorer (served here "
                  "by predicted-ttft-scorer)",
    "slo-aware-profile-handler": "an experimental build's plugin (GIE v1.2 era); use one profile with latency-scorer "
                                 "and slo-headroom-tier-filter",
    "slo-aware-routing": "GIE v1.2's name before llm-d's latency plugins; use latency-scorer (served here by "
                         "predicted-ttft-scorer)",
    "pd-slo-optimizer": "an experimental build's plugin; use latency-scorer per profile (served here by "
                        "predicted-ttft-scorer)",
    "pd-slo-profile-handler": "an experimental build's plugin; use disagg-profile-handler with prefix-based-pd-decider",
    "thunder-agent": "ThunderAgent is not implemented; program-aware-fairness with agent-identity and "
                     "concurrency-detector is the nearest (docs/agentic.md)",
    "local-syncer": "cross-replica syncers are not supported: pickers of one pool share state over the peer link "
                    "(--peers or --workers)",
    "redis-state-store": "cross-replica syncers are not supported: pickers of one pool share state over the peer "
                         "link (--peers or --workers)",
}


def mapping_line(type_name: str, configured_as: str, parameters: Mapping[str, Any],
                 taken: list[str] | None = None, notes: list[str] | None = None) -> str | None:
    """What `epp check-config` prints for an llm-d type: meaning, parameters taken, differences."""
    info = LLMD_TYPES.get(configured_as)
    if info is None:
        return None
    target = type_name if type_name == configured_as else f"{type_name} (configured as {configured_as})"
    line = f"llm-d {configured_as} -> {target}: {info.meaning}"
    keys = taken if taken is not None else list(parameters)
    line += f"; parameters taken: {', '.join(keys) if keys else 'none'}"
    if info.differences:
        line += f"; differences: {info.differences}"
    for note in notes or ():
        line += f"; {note}"
    return line


def refused(type_name: str, registered: bool) -> str | None:
    """Why an llm-d type is refused, or None (a type registered here by a plugin package is not refused)."""
    if registered:
        return None
    reason = REFUSED_TYPES.get(type_name) or REFUSED_OTHER_TYPES.get(type_name)
    return f"llm-d plugin type {type_name!r} is not supported here: {reason}" if reason else None
