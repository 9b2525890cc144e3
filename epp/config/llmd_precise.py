"""llm-d's nested `precise-prefix-cache-producer` parameters, mapped onto the producer's own.

llm-d configures the producer with `tokenProcessorConfig`, `indexerConfig`, `kvEventsConfig`,
`speculativeIndexing` and `speculativeTTL` (R `requestcontrol/dataproducer/preciseprefixcache`).
A document in that shape gets llm-d's defaults (topic filter `kv@`, speculative indexing off);
the flat parameters of our own shape (`tokenizers`, `tierWeights`, ...) may sit beside them.
Every llm-d field maps onto a producer parameter, is accepted with a note saying why it has no
effect here, or is refused naming the field; unknown fields are refused, as llm-d's strict
decoder does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epp.framework.errors import ConfigError

LLMD_FIELDS = ("tokenProcessorConfig", "indexerConfig", "kvEventsConfig", "speculativeIndexing", "speculativeTTL",
               "sessionManager")
# The fields that mark a document in llm-d's shape (speculativeTTL is a parameter of ours too).
_LLMD_MARKERS = ("tokenProcessorConfig", "indexerConfig", "kvEventsConfig", "speculativeIndexing", "sessionManager")
TOKEN_PROCESSOR_FIELDS = ("blockSizeTokens", "blockSize", "hashSeed", "hashAlgorithm")
INDEXER_FIELDS = ("kvBlockIndexConfig", "kvCacheBackendConfigs", "tokenizersPoolConfig", "prefixStoreConfig",
                  "tokenProcessorConfig", "speculativeIndexing")
TOKENIZERS_POOL_FIELDS = ("modelName", "workersCount", "hf", "local", "uds")
BLOCK_INDEX_FIELDS = ("inMemoryConfig", "redisConfig", "costAwareMemoryConfig", "enableMetrics",
                      "metricsLoggingInterval")
KV_EVENTS_FIELDS = ("zmqEndpoint", "topicFilter", "concurrency", "engineType", "discoverPods", "podDiscoveryConfig",
                    "tracing", "dataParallelSizeLocal", "servingPortBase")
POD_DISCOVERY_FIELDS = ("podLabelSelector", "podNamespace", "socketPort", "replaySocketPort", "dataParallelSizeTotal",
                        "dataParallelSize")
HASH_ALGORITHMS = ("cbor-fnv", "xxh64")
TIERS = ("gpu", "cpu", "disk")
LLMD_TOPIC_FILTER = "kv@"
_KEYS_NOTE = ("no effect: block keys are computed by the picker from token ids on both sides (the prompt and "
              "the KV events' token_ids), so they need not match the engine, as llm-d's README says")


def is_llmd_shape(params: Mapping[str, Any] | None) -> bool:
    """Whether these producer parameters use llm-d's nested fields."""
    return bool(params) and any(key in params for key in _LLMD_MARKERS)  # type: ignore[operator]


class _Mapper:
    """One translation; `fail(field, message)` raises the error naming the parameter path."""

    def __init__(self, name: str, raw: Mapping[str, Any]) -> None:
        self.name = name
        self.out: dict[str, Any] = {k: v for k, v in raw.items() if k not in LLMD_FIELDS}
        self.notes: list[str] = []
        # The notes that say something is served differently from llm-d (a subset of notes).
        self.notices: list[str] = []
        self.taken: list[str] = []

    def fail(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"plugin {self.name!r}: parameter {path!r}: {message}")

    def mapping(self, value: Any, path: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping with fields {list(allowed)}, got {value!r}")
        for key in value:
            if key not in allowed:
                raise self.fail(f"{path}.{key}", f"unknown field; allowed: {', '.join(allowed)}")
        return value

    def typed(self, value: Any, path: str, kind: type | tuple[type, ...], what: str) -> Any:
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise self.fail(path, f"must be {what}, got {value!r}")
        if not isinstance(value, kind):
            raise self.fail(path, f"must be {what}, got {value!r}")
        return value

    def set(self, key: str, value: Any, path: str) -> None:
        """Our parameter `key` from llm-d's `path`; the same parameter set twice is an error."""
        if key in self.out:
            raise self.fail(path, f"sets {key!r}, which the parameters also give directly; set it once")
        self.out[key] = value
        self.taken.append(path)

    def note(self, path: str, message: str) -> None:
        self.taken.append(path)
        self.notes.append(f"{path}: {message}")


def precise_parameters(name: str, raw: Mapping[str, Any], *, token_producer: bool, token_model: str | None = None
                       ) -> tuple[dict[str, Any], list[str], list[str], list[str]]:
    """(our parameters, the llm-d fields taken, notes, notices) for llm-d-shaped producer parameters; the
    notices (fields served differently from llm-d) are among the notes too.

    `token_producer`: the document configures a `token-producer`, which then supplies the tokens
    (unless the parameters give our own `tokenizers`); `token_model`: the one model it renders for.
    """
    m = _Mapper(name, raw)
    raw = _older_placements(m, raw)
    _token_processor(m, raw.get("tokenProcessorConfig"))
    _indexer(m, raw.get("indexerConfig"))
    _kv_events(m, raw.get("kvEventsConfig"))
    speculative = raw.get("speculativeIndexing")
    if speculative is not None:
        m.typed(speculative, "speculativeIndexing", bool, "true or false")
        m.taken.append("speculativeIndexing")
    if raw.get("speculativeTTL") is not None:
        m.set("speculativeTTL", raw["speculativeTTL"], "speculativeTTL")
    if not speculative:
        # llm-d's default: no speculative entries (our own shape claims picks for speculativeTTL).
        m.out["speculativeTTL"] = 0
        if raw.get("speculativeTTL") is not None:
            m.notes.append("speculativeTTL: no effect while speculativeIndexing is false")
    if raw.get("sessionManager") is not None:
        raise m.fail("sessionManager", "not supported: no session cache manager is registered here (llm-d ships "
                     "none either)")
    if token_producer and "tokenizers" not in m.out:
        m.out["useTokenProducer"] = True
        if token_model is not None and "defaultModel" not in m.out:
            # vLLM publishes on topic "" unless told otherwise: without a model in the topic, the events are
            # the model's the token-producer renders for (else they would all be dropped).
            m.out["defaultModel"] = token_model
    elif "tokenizers" not in m.out:
        m.notes.append("no token source: llm-d would auto-create a token-producer with the `estimate` backend, "
                       "whose token ids never match the engine's; here only requests that carry token ids are "
                       "matched. Add a token-producer with the vllm backend, or our `tokenizers` parameter")
    return m.out, m.taken, m.notes + m.notices, m.notices


def _older_placements(m: _Mapper, raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """llm-d-kv-cache-manager's placement of `tokenProcessorConfig` and `speculativeIndexing` inside
    `indexerConfig` (older guides), moved to the top level where llm-d reads them now."""
    indexer = raw.get("indexerConfig")
    if not isinstance(indexer, dict) or not ({"tokenProcessorConfig", "speculativeIndexing"} & set(indexer)):
        return raw
    moved = dict(raw)
    inner = dict(indexer)
    for key in ("tokenProcessorConfig", "speculativeIndexing"):
        if key in inner:
            if raw.get(key) is not None:
                raise m.fail(f"indexerConfig.{key}", f"is set both here (its older place) and at the top level; keep "
                             f"the top-level {key}")
            moved[key] = inner.pop(key)
            m.notes.append(f"indexerConfig.{key}: DEPRECATION: its older place (llm-d-kv-cache-manager); read as the "
                           f"top-level {key}")
    moved["indexerConfig"] = inner
    return moved


def _token_processor(m: _Mapper, raw: Any) -> None:
    item = m.mapping(raw, "tokenProcessorConfig", TOKEN_PROCESSOR_FIELDS)
    if item.get("blockSizeTokens") is not None and item.get("blockSize") is not None:
        raise m.fail("tokenProcessorConfig.blockSize", "is the deprecated name of blockSizeTokens; set one of them")
    for key in ("blockSizeTokens", "blockSize"):
        if item.get(key) is not None:
            path = f"tokenProcessorConfig.{key}"
            value = m.typed(item[key], path, int, "a positive integer (tokens per block)")
            if value < 1:
                raise m.fail(path, f"must be >= 1, got {value}")
            m.set("blockSizeTokens", value, path)
            if key == "blockSize":
                m.notes.append(f"{path}: deprecated in llm-d; read as blockSizeTokens")
    if item.get("hashSeed") is not None:
        m.typed(item["hashSeed"], "tokenProcessorConfig.hashSeed", str, "a string")
        m.note("tokenProcessorConfig.hashSeed", _KEYS_NOTE)
    if item.get("hashAlgorithm") is not None:
        value = m.typed(item["hashAlgorithm"], "tokenProcessorConfig.hashAlgorithm", str, "a string")
        if value not in HASH_ALGORITHMS:
            raise m.fail("tokenProcessorConfig.hashAlgorithm", f"must be one of {list(HASH_ALGORITHMS)}, got {value!r}")
        m.note("tokenProcessorConfig.hashAlgorithm", _KEYS_NOTE)


def _indexer(m: _Mapper, raw: Any) -> None:
    item = m.mapping(raw, "indexerConfig", INDEXER_FIELDS)
    if item.get("tokenizersPoolConfig") is not None:
        _tokenizers_pool(m, item["tokenizersPoolConfig"])
    if item.get("prefixStoreConfig") is not None:
        raise m.fail("indexerConfig.prefixStoreConfig", "not supported: llm-d removed it (no prefix store; prompts "
                     "are tokenized whole)")
    index = m.mapping(item.get("kvBlockIndexConfig"), "indexerConfig.kvBlockIndexConfig", BLOCK_INDEX_FIELDS)
    base = "indexerConfig.kvBlockIndexConfig"
    if index.get("costAwareMemoryConfig") is not None:
        raise m.fail(f"{base}.costAwareMemoryConfig", "not supported: the in-memory index is bounded by its entry "
                     "count (inMemoryConfig.size), not by bytes")
    in_memory = m.mapping(index.get("inMemoryConfig"), f"{base}.inMemoryConfig", ("size", "podCacheSize"))
    redis = m.mapping(index.get("redisConfig"), f"{base}.redisConfig", ("address",))
    if redis.get("address") is not None:
        address = m.typed(redis["address"], f"{base}.redisConfig.address", str, "a Redis address")
        m.set("indexBackend", "redis", f"{base}.redisConfig")
        m.set("redisUrl", address if "://" in address else f"redis://{address}", f"{base}.redisConfig.address")
        if in_memory:
            m.notes.append(f"{base}.inMemoryConfig: no effect, redisConfig wins (as in llm-d)")
    elif index.get("redisConfig") is not None:
        raise m.fail(f"{base}.redisConfig.address", "is required (redis://host:port)")
    else:
        if in_memory.get("size") is not None:
            size = m.typed(in_memory["size"], f"{base}.inMemoryConfig.size", int, "a positive integer (block keys)")
            if size < 1:
                raise m.fail(f"{base}.inMemoryConfig.size", f"must be >= 1, got {size}")
            m.set("indexCapacity", size, f"{base}.inMemoryConfig.size")
    if in_memory.get("podCacheSize") is not None:
        m.typed(in_memory["podCacheSize"], f"{base}.inMemoryConfig.podCacheSize", int, "a positive integer")
        m.note(f"{base}.inMemoryConfig.podCacheSize", "no effect: a block key lists every endpoint holding it "
               "(bounded by the pool), not the last podCacheSize pods")
    for key in ("enableMetrics", "metricsLoggingInterval"):
        if index.get(key) is not None:
            m.note(f"{base}.{key}", "no effect: the index's metrics are always on the metrics port "
                   "(epp_kv_index_*)")
    backends = item.get("kvCacheBackendConfigs")
    if backends is not None:
        path = "indexerConfig.kvCacheBackendConfigs"
        if not isinstance(backends, list):
            raise m.fail(path, f"must be a list of {{name, weight}}, got {backends!r}")
        weights: dict[str, float] = {}
        for i, raw_backend in enumerate(backends):
            backend = m.mapping(raw_backend, f"{path}[{i}]", ("name", "weight"))
            tier = backend.get("name")
            if tier not in TIERS:
                raise m.fail(f"{path}[{i}].name", f"must be one of {list(TIERS)}, got {tier!r}")
            weight = m.typed(backend.get("weight", 1.0), f"{path}[{i}].weight", (int, float), "a number >= 0")
            weights[tier] = float(weight)
        m.set("tierWeights", weights, path)


def _tokenizers_pool(m: _Mapper, raw: Any) -> None:
    """The deprecated scorer's own tokenizer (llm-d v0.8: a sidecar or the hub, by model name) -> ours in process."""
    from epp.tokenization.hub import hub_source

    base = "indexerConfig.tokenizersPoolConfig"
    pool = m.mapping(raw, base, TOKENIZERS_POOL_FIELDS)
    model = pool.get("modelName")
    if not isinstance(model, str) or not model:
        raise m.fail(f"{base}.modelName", "is required (the model whose tokenizer to load)")
    if pool.get("local") is not None:
        raise m.fail(f"{base}.local", "not supported: give the tokenizer directories with our `tokenizers: "
                     "{model: directory}` parameter")
    hf = m.mapping(pool.get("hf"), f"{base}.hf", ("huggingFaceToken", "tokenizersCacheDir"))
    uds = m.mapping(pool.get("uds"), f"{base}.uds", ("socketFile",))
    m.set("tokenizers", {model: hub_source(model)}, f"{base}.modelName")
    source = "llm-d's tokenizer sidecar is not used: " if uds else ""
    m.notices.append(f"{base}: {source}{model}'s tokenizer files are fetched from the Hugging Face hub (HF_TOKEN, "
                     "cached in HF_HOME) and run in the picker")
    for key in ("huggingFaceToken", "tokenizersCacheDir"):
        if hf.get(key) is not None:
            m.note(f"{base}.hf.{key}", "no effect: the hub client reads HF_TOKEN and HF_HOME from the environment")
    if pool.get("workersCount") is not None:
        m.note(f"{base}.workersCount", "no effect: long prompts are tokenized in the picker's worker threads")


def _kv_events(m: _Mapper, raw: Any) -> None:
    item = m.mapping(raw, "kvEventsConfig", KV_EVENTS_FIELDS)
    pods_raw = item.get("podDiscoveryConfig")
    ranks = item.get("dataParallelSizeLocal")
    if ranks is not None or item.get("servingPortBase") is not None:
        # Data-parallel ranks served on consecutive ports, each its own endpoint (vLLM's external load
        # balancing): rank r serves on servingPortBase + r and publishes on socketPort + r.
        if ranks is None or item.get("servingPortBase") is None:
            raise m.fail("kvEventsConfig.dataParallelSizeLocal", "goes with servingPortBase: the ranks' serving "
                         "ports are servingPortBase + rank")
        if m.typed(ranks, "kvEventsConfig.dataParallelSizeLocal", int, "a positive integer") < 1:
            raise m.fail("kvEventsConfig.dataParallelSizeLocal", f"must be >= 1, got {ranks}")
        m.set("ranksPerHost", ranks, "kvEventsConfig.dataParallelSizeLocal")
        m.set("rankPortBase", _port(m, item["servingPortBase"], "kvEventsConfig.servingPortBase"),
              "kvEventsConfig.servingPortBase")
    if isinstance(pods_raw, dict) and pods_raw.get("dataParallelSize") not in (None, 1):
        raise m.fail("kvEventsConfig.podDiscoveryConfig.dataParallelSize", "not supported: ranks sharing one serving "
                     "port (vLLM internal or hybrid load balancing) are not addressed per rank here; serve each rank "
                     "on its own port (external load balancing: one endpoint per rank, kv-events-port per rank or "
                     "dataParallelSizeLocal with servingPortBase)")
    if isinstance(pods_raw, dict) and pods_raw.get("dataParallelSizeTotal") is not None:
        m.typed(pods_raw["dataParallelSizeTotal"], "kvEventsConfig.podDiscoveryConfig.dataParallelSizeTotal", int,
                "a positive integer")
        m.note("kvEventsConfig.podDiscoveryConfig.dataParallelSizeTotal", "no effect: each endpoint is one rank, "
               "its event ports offset by its rank on its host (dataParallelSizeLocal)")
    if isinstance(pods_raw, dict) and pods_raw.get("dataParallelSize") == 1:
        m.note("kvEventsConfig.podDiscoveryConfig.dataParallelSize", "1: one rank per endpoint, as here")
    engine = item.get("engineType")
    if engine is not None and engine not in ("vllm", "sglang"):
        raise m.fail("kvEventsConfig.engineType", f"{engine!r} is not supported; allowed: vllm, sglang")
    if engine == "sglang":
        m.note("kvEventsConfig.engineType", "sglang: SGLang's KV events (batch [ts, events, dp_rank]; BlockStored "
               "block_hashes, parent, token_ids, block_size, lora_id, medium, ...) are the leading fields of vLLM's "
               "layout and its topics are kv@<pod>@<model>: the one decoder reads both")
    elif engine is not None:
        m.taken.append("kvEventsConfig.engineType")
    if item.get("topicFilter") is not None:
        m.set("topicFilter", m.typed(item["topicFilter"], "kvEventsConfig.topicFilter", str, "a string"),
              "kvEventsConfig.topicFilter")
    else:
        m.out.setdefault("topicFilter", LLMD_TOPIC_FILTER)  # llm-d's default
    if item.get("concurrency") is not None:
        value = m.typed(item["concurrency"], "kvEventsConfig.concurrency", int, "a positive integer")
        if value < 1:
            raise m.fail("kvEventsConfig.concurrency", f"must be >= 1, got {value}")
        m.note("kvEventsConfig.concurrency", "no effect: each endpoint's events are applied in order on the event "
               "loop; the index is the same for any number of llm-d workers")
    if item.get("tracing") is not None:
        m.typed(item["tracing"], "kvEventsConfig.tracing", bool, "true or false")
        if item["tracing"]:
            raise m.fail("kvEventsConfig.tracing", "not supported: KV events are not traced here")
        m.taken.append("kvEventsConfig.tracing")
    discover = item.get("discoverPods")
    if discover is not None:
        m.typed(discover, "kvEventsConfig.discoverPods", bool, "true or false")
    zmq_endpoint = item.get("zmqEndpoint")
    pods = m.mapping(item.get("podDiscoveryConfig"), "kvEventsConfig.podDiscoveryConfig", POD_DISCOVERY_FIELDS)
    if zmq_endpoint is not None:
        m.typed(zmq_endpoint, "kvEventsConfig.zmqEndpoint", str, "a ZMQ endpoint such as tcp://*:5557")
        if discover:
            # llm-d binds the socket and also dials every pod; one mode per producer here: the pods are dialled.
            m.taken.append("kvEventsConfig.zmqEndpoint")
            m.notices.append(f"kvEventsConfig.zmqEndpoint: {zmq_endpoint} is not bound: with discoverPods each "
                             "endpoint's publisher is dialled (one mode per producer here); replicas that connect "
                             "out to a central socket are not heard")
            zmq_endpoint = None
    if zmq_endpoint is not None:
        m.set("mode", "centralized", "kvEventsConfig.zmqEndpoint")
        m.set("zmqEndpoint", zmq_endpoint, "kvEventsConfig.zmqEndpoint")
        if pods:
            raise m.fail("kvEventsConfig.podDiscoveryConfig", "applies to discoverPods, not to zmqEndpoint")
        if "ranksPerHost" in m.out:
            raise m.fail("kvEventsConfig.dataParallelSizeLocal", "applies to discoverPods (per-rank sockets to dial), "
                         "not to zmqEndpoint (the topic names each rank's endpoint)")
        return
    if discover is False:
        m.set("subscribe", False, "kvEventsConfig.discoverPods")
        m.notes.append("kvEventsConfig: no zmqEndpoint and discoverPods false: no KV events are received, the "
                       "index holds speculative entries only")
        return
    m.set("mode", "per-endpoint", "kvEventsConfig.discoverPods")
    base = "kvEventsConfig.podDiscoveryConfig"
    if pods.get("socketPort") is not None:
        m.set("eventsPort", _port(m, pods["socketPort"], f"{base}.socketPort"), f"{base}.socketPort")
    if pods.get("replaySocketPort") is not None:
        m.set("replayPort", _port(m, pods["replaySocketPort"], f"{base}.replaySocketPort"),
              f"{base}.replaySocketPort")
    for key in ("podLabelSelector", "podNamespace"):
        if pods.get(key) is not None:
            m.typed(pods[key], f"{base}.{key}", str, "a string")
            m.note(f"{base}.{key}", "no effect: every endpoint of the pool is subscribed to (the pool's own "
                   "selector already chose its pods)")


def _port(m: _Mapper, value: Any, path: str) -> int:
    port: int = m.typed(value, path, int, "a port number")
    if not 1 <= port <= 65535:
        raise m.fail(path, f"must be a port number (1-65535), got {port}")
    return port

