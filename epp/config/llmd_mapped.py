"""llm-d plugin types that need a part this picker does not run, served by our nearest equivalent.

Each entry says which of our plugins serves the type (or that what it does is done without a
plugin here), adapts llm-d's parameters (every one is taken, noted as having no effect with the
reason, or refused naming it), and gives the one-line notice `epp check-config` prints. A package
that registers the real type (through the `epp.plugins` entry points) is used instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from epp.framework.durations import parse_duration
from epp.framework.errors import ConfigError
from epp.framework.plugin import Plugin

# (llm-d parameters) -> (our parameters, one note per llm-d parameter that acts differently)
Adapter = Callable[[str, Mapping[str, Any]], tuple[dict[str, Any], list[str]]]


class Absorbed(Plugin):
    """An llm-d plugin whose work is done here without a plugin of its own (the notice says by what).

    It has no place in a profile or a stage: the loader keeps it only so references to its name
    resolve and `epp check-config` can say what serves it.
    """

    def __init__(self, name: str, llmd_type: str, served_by: str) -> None:
        super().__init__(name)
        self.type_name = llmd_type  # type: ignore[misc]  # the llm-d type it stands for, per instance
        self.served_by = served_by

    def describe(self) -> str:
        return f"no plugin here: {self.served_by}"


@dataclass(frozen=True)
class MappedType:
    """How one llm-d type is served: by `target` (one of our types) or, None, without a plugin."""

    target: str | None
    notice: str
    adapt: Adapter = field(default=lambda name, params: ({}, []))
    # The llm-d parameters the type takes (anything else is refused, as llm-d's strict decoder does).
    parameters: tuple[str, ...] = ()


def _fail(name: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"plugin {name!r}: parameter {key!r}: {message}")


def _number(name: str, params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise _fail(name, key, f"must be a number >= 0, got {value!r}")
    return float(value)


def _noted(params: Mapping[str, Any], keys: tuple[str, ...], why: str) -> list[str]:
    return [f"{key}: {why}" for key in keys if key in params]


def _latency_scorer(name: str, params: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    ttft = _number(name, params, "ttftWeight", 0.8)
    tpot = _number(name, params, "tpotWeight", 0.2)
    if ttft == 0 and tpot == 0:
        raise _fail(name, "ttftWeight", "ttftWeight and tpotWeight are both 0: the scorer would score nothing")
    strategy = params.get("headroomSelectionStrategy", "least")
    if strategy not in ("least", "most"):
        raise _fail(name, "headroomSelectionStrategy", f"must be least or most, got {strategy!r}")
    for key in ("compositeKVWeight", "compositeQueueWeight", "compositePrefixWeight"):
        _number(name, params, key, 1.0)
    notes = []
    if ttft == 0:
        notes.append("ttftWeight 0: this scorer ranks by predicted TPOT in llm-d; here it ranks by predicted TTFT "
                     "(TPOT objectives are enforced by tpot-slo-filter, not scored)")
    elif tpot:
        notes.append(f"tpotWeight {tpot:g}: no effect (endpoints are ranked by predicted TTFT; TPOT objectives are "
                     "enforced by tpot-slo-filter)")
    notes += _noted(params, ("headroomSelectionStrategy",), "no effect: the score is min(T)/T(e) over predicted "
                    "TTFT, not a headroom pick")
    notes += _noted(params, ("compositeKVWeight", "compositeQueueWeight", "compositePrefixWeight"),
                    "no effect: there is no composite fallback, predictions exist from the first request (learned "
                    "from defaults on)")
    return {}, notes


def _predicted_latency_producer(name: str, params: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    for key in ("samplingMean", "maxDecodeTokenSamplesForPrediction", "sloBufferFactor"):
        _number(name, params, key, 0.0)
    for key in ("streamingMode", "predictInProduce", "useEncoderCacheFeatures"):
        if key in params and not isinstance(params[key], bool):
            raise _fail(name, key, f"must be true or false, got {params[key]!r}")
    if "contextTTL" in params:
        parse_duration(params["contextTTL"], what=f"plugin {name!r}: parameter 'contextTTL'")
    for key in ("endpointRoleLabel", "encoderCacheMatchInfoProducerName"):
        if key in params and not isinstance(params[key], str):
            raise _fail(name, key, f"must be a string, got {params[key]!r}")
    notes = _noted(params, tuple(k for k in params if k != "streamingMode"),
                   "no effect: there is no predictor sidecar to feed; predicted-ttft-scorer learns from the "
                   "picker's own requests")
    if params.get("streamingMode"):
        notes.append("streamingMode: TTFT is always learned at the first streamed token here (a non-streamed "
                     "response teaches nothing), as llm-d does with true")
    return {}, notes


def _slo_headroom_tier_filter(name: str, params: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    epsilon = _number(name, params, "epsilonExploreNeg", 0.01)
    if epsilon > 1:
        raise _fail(name, "epsilonExploreNeg", f"must be a probability in [0, 1], got {epsilon:g}")
    return {}, _noted(params, ("epsilonExploreNeg",), "no effect: endpoints that miss the objective are never "
                      "explored on purpose; when none meets it, the nearest ones are kept")


BURST_FIELDS = ("maxPerReplica", "minColocateBlocks", "windowDurationMs")


def _burst_prefix(name: str, params: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    for key in BURST_FIELDS:  # -1 is llm-d's "no limit"
        value = params.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(name, key, f"must be a number, got {value!r}")
    return ({k: v for k, v in params.items() if k not in BURST_FIELDS},
            _noted(params, BURST_FIELDS, "no effect: there is no burst window; each pick is recorded as it is made"))


MAPPED_TYPES: Mapping[str, MappedType] = {
    "predicted-latency-producer": MappedType(
        None, "no latency-predictor sidecar: predicted-ttft-scorer (serving latency-scorer) learns each endpoint's "
        "TTFT and TPOT online from the picker's own requests, so no producer is needed",
        _predicted_latency_producer,
        ("samplingMean", "maxDecodeTokenSamplesForPrediction", "sloBufferFactor", "contextTTL", "streamingMode",
         "endpointRoleLabel", "predictInProduce", "useEncoderCacheFeatures", "encoderCacheMatchInfoProducerName")),
    "latency-scorer": MappedType(
        "predicted-ttft-scorer", "ranks endpoints by TTFT predicted from queue, uncached prefill and running "
        "requests, learned online (no predictor sidecar)", _latency_scorer,
        ("ttftWeight", "tpotWeight", "headroomSelectionStrategy", "compositeKVWeight", "compositeQueueWeight",
         "compositePrefixWeight")),
    "slo-headroom-tier-filter": MappedType(
        "tpot-slo-filter", "keeps the endpoints predicted to meet the request's TPOT objective (x-llm-d-slo-tpot-ms), "
        "else the nearest; TTFT objectives order and shed the flow-control queue (slo-deadline-ordering-policy), "
        "they do not filter", _slo_headroom_tier_filter, ("epsilonExploreNeg",)),
    "latency-slo-admitter": MappedType(
        None, "the saturation admitter (always present without flow control) sheds sheddable requests "
        "(priority < 0) while the pool is saturated; it does not predict per-request latency"),
    "dp-rank-header-handler": MappedType(
        None, "x-data-parallel-rank is not set: the pod's vLLM spreads requests over the ranks that share its port "
        "(internal load balancing) and prefix matches are per endpoint, not per rank; for rank-level affinity serve "
        "each rank on its own port (one endpoint per rank, InferencePool targetPorts)"),
    "burst-prefix-cache-producer": MappedType(
        "approx-prefix-cache-producer", "the approximate producer records each pick at once, so a burst of "
        "requests with one prefix already follows the first pick", _burst_prefix,
        ("autoTune", "blockSize", "blockSizeTokens", "maxPrefixBlocksToMatch", "maxPrefixTokensToMatch",
         "lruCapacityPerServer", *BURST_FIELDS)),
    "header-phase-profile-handler": MappedType(
        "header-profile-handler", "the name header-profile-handler had before it was merged (llm-d-router #2134, "
        "which read the EPP-Phase header): loaded as header-profile-handler with headerName EPP-Phase",
        lambda name, params: ({"headerName": "EPP-Phase", **params}, []), ("headerName", "defaultProfile")),
}


def _token_producer_params(name: str, params: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """llm-d v0.8's UDS tokenizer sidecar (`udsTokenizerConfig`) -> the model's tokenizer loaded in process."""
    uds = params.get("udsTokenizerConfig")
    if uds is None:
        return dict(params), []
    if not isinstance(uds, dict) or set(uds) - {"socketFile"}:
        raise _fail(name, "udsTokenizerConfig", f"must be a mapping with field socketFile, got {uds!r}")
    model = params.get("modelName")
    if not isinstance(model, str) or not model:
        raise _fail(name, "modelName", "is required with udsTokenizerConfig (the model whose tokenizer to load)")
    if params.get("vllm") is not None or params.get("tokenizers") is not None:
        raise _fail(name, "udsTokenizerConfig", "goes with neither vllm nor tokenizers: set one tokenizer source")
    from epp.tokenization.hub import hub_source

    ours = {k: v for k, v in params.items() if k not in ("udsTokenizerConfig", "modelName")}
    ours["tokenizers"] = {model: hub_source(model)}
    return ours, [f"udsTokenizerConfig: llm-d's tokenizer sidecar is not used: {model}'s tokenizer files are fetched "
                  "from the Hugging Face hub (HF_TOKEN, cached in HF_HOME) and run in process"]


def _pd_profile_handler_params(name: str, params: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """llm-d v0.3-v0.5's `hashBlockSize`: the prefix block size the threshold was counted in."""
    if "hashBlockSize" not in params:
        return dict(params), []
    value = params["hashBlockSize"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(name, "hashBlockSize", f"must be a positive integer, got {value!r}")
    return ({k: v for k, v in params.items() if k != "hashBlockSize"},
            ["hashBlockSize: no effect (llm-d v0.3-v0.5's prefix block size): uncached tokens are counted with the "
             "prefix producer's own blocks"])


def _mm_producer_params(name: str, params: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """llm-d's mm-embeddings sample config writes `cacheSizeInMB`, a field the plugin does not read (Go's
    decoder ignores it, so the default budget applies there): the same here, said once."""
    if "cacheSizeInMB" not in params:
        return dict(params), []
    value = params["cacheSizeInMB"]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, "cacheSizeInMB", f"must be an integer, got {value!r}")
    return ({k: v for k, v in params.items() if k != "cacheSizeInMB"},
            [f"cacheSizeInMB: {value}: no effect: llm-d's producer reads cacheSizeInMBPerServer and ignores this "
             "field, so its default (4096 MiB) applies, as here; write cacheSizeInMBPerServer to size the cache"])


def _approx_producer_params(name: str, params: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`prefixHashSource: metadata` (llm-d-router #1972): block hashes handed over by an upstream ext_proc
    in Envoy's dynamic metadata. Here the producer hashes the prompt itself: the same affinity, computed
    from the body."""
    if "prefixHashSource" not in params:
        return dict(params), []
    value = params["prefixHashSource"]
    ours = {k: v for k, v in params.items() if k != "prefixHashSource"}
    if value in ("", "prompt", "tokens"):
        return ours, []
    if value != "metadata":
        raise _fail(name, "prefixHashSource", f"must be metadata (or unset), got {value!r}")
    return ours, ["prefixHashSource: metadata: block hashes are not read from Envoy's dynamic metadata (an upstream "
                  "ext_proc's): this producer hashes the prompt itself, the same affinity computed from the body"]


# Parameters of types we serve under their own name that llm-d configs write in an older or
# sidecar-bound form: adapted before the plugin is built, each adaptation a notice.
PARAMETER_ADAPTERS: Mapping[str, Adapter] = {
    "token-producer": _token_producer_params,
    "pd-profile-handler": _pd_profile_handler_params,
    "mm-embeddings-cache-producer": _mm_producer_params,
    "approx-prefix-cache-producer": _approx_producer_params,
}


def adapt(type_name: str, name: str, params: Mapping[str, Any] | None) -> tuple[MappedType, dict[str, Any], list[str]]:
    """The mapping of llm-d `type_name`, our parameters, and the per-parameter notes (ConfigError names a
    parameter llm-d does not take either)."""
    mapped = MAPPED_TYPES[type_name]
    given = dict(params or {})
    unknown = sorted(set(given) - set(mapped.parameters))
    if unknown:
        allowed = ", ".join(mapped.parameters) or "none"
        raise ConfigError(f"plugin {name!r}: unknown parameter(s) {unknown} for llm-d's {type_name}; allowed: "
                          f"{allowed}")
    ours, notes = mapped.adapt(name, given)
    return mapped, ours, notes
