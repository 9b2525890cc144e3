"""Data-layer plugin types of llm-d/GIE configs: their settings reach the scraper (parsers: epp.scorers.parsers).

`metrics-data-source` holds how endpoints' metrics are scraped (scheme, path, TLS, interval,
families); the loader turns it into the scrape settings the server's scraper runs with.
`core-metrics-extractor` names the engine whose series are read (vLLM only), and
`endpoint-notification-source` is what llm-d wires to producers that follow the pool's
endpoints, which they always do here.
"""

from __future__ import annotations

import ssl

from epp.framework import ConfigError, Plugin, PluginContext, PluginParams

SUPPORTED_ENGINES = ("vllm",)
# What core-metrics-extractor reads from vLLM (a `families` list must keep them).
CORE_FAMILIES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "vllm:cache_config_info")
# Further series this picker reads when they are kept (prefix-cache counters, sleep state).
OPTIONAL_FAMILIES = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:engine_sleep_state")


class MetricsDataSource(Plugin):
    """Where model-server metrics are scraped: `scheme`, `path`, TLS (`insecureSkipVerify`, CA, client
    certificate), `interval`, and the metric `families` kept."""

    type_name = "metrics-data-source"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.scheme = params.str("scheme", "http", choices=("http", "https"))
        self.path = params.str("path", "/metrics") or "/metrics"
        if not self.path.startswith("/"):
            raise ConfigError(f"plugin {name!r}: parameter 'path' must start with '/', got {self.path!r}")
        # llm-d's default: model-server pods serve self-signed certificates.
        self.insecure_skip_verify = params.bool("insecureSkipVerify", True)
        self.ca_cert_path = params.str("caCertPath", None)
        self.client_cert_path = params.str("clientCertPath", None)
        self.client_key_path = params.str("clientKeyPath", None)
        if (self.client_cert_path is None) != (self.client_key_path is None):
            raise ConfigError(f"plugin {name!r}: parameters 'clientCertPath' and 'clientKeyPath' go together; "
                              "set both or neither")
        if self.scheme == "http" and (self.ca_cert_path or self.client_cert_path):
            raise ConfigError(f"plugin {name!r}: caCertPath and clientCertPath need scheme https")
        self._check_files(name)
        interval = params.duration("interval", 0.0)
        self.interval_s = interval or None
        families = params.list("families", None)
        self.families = None if families is None else self._families(name, families)

    def _check_files(self, name: str) -> None:
        """Load the CA and client certificate once, so a wrong path fails at start-up, not at the first scrape."""
        context = ssl.create_default_context()
        if self.ca_cert_path:
            try:
                context.load_verify_locations(cafile=self.ca_cert_path)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"plugin {name!r}: parameter 'caCertPath': cannot load {self.ca_cert_path!r}: "
                                  f"{exc}") from None
        if self.client_cert_path and self.client_key_path:
            try:
                context.load_cert_chain(self.client_cert_path, self.client_key_path)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"plugin {name!r}: parameters 'clientCertPath'/'clientKeyPath': cannot load "
                                  f"{self.client_cert_path!r}: {exc}") from None

    @staticmethod
    def _families(name: str, families: list[object]) -> frozenset[str]:
        if not all(isinstance(f, str) and f for f in families):
            raise ConfigError(f"plugin {name!r}: parameter 'families' must be a list of metric family names")
        kept = frozenset(str(f) for f in families)
        missing = [f for f in CORE_FAMILIES if f not in kept]
        if missing:
            raise ConfigError(f"plugin {name!r}: parameter 'families' must keep every family "
                              f"core-metrics-extractor reads; missing: {', '.join(missing)}")
        unknown = sorted(kept - set(CORE_FAMILIES) - set(OPTIONAL_FAMILIES))
        if unknown:
            raise ConfigError(f"plugin {name!r}: parameter 'families': {', '.join(unknown)} would not be read "
                              f"here; allowed: {', '.join(CORE_FAMILIES + OPTIONAL_FAMILIES)}")
        return kept

    def describe(self) -> str:
        text = (f"scheme={self.scheme} path={self.path} "
                f"insecureSkipVerify={str(self.insecure_skip_verify).lower()}")
        if self.ca_cert_path:
            text += f" caCertPath={self.ca_cert_path}"
        if self.client_cert_path:
            text += f" clientCertPath={self.client_cert_path}"
        if self.interval_s:
            text += f" interval={self.interval_s:g}s"
        if self.families is not None:
            text += f" families={','.join(sorted(self.families))}"
        return text


class CoreMetricsExtractor(Plugin):
    """Which metric series are read: vLLM's (`defaultEngine: vllm`)."""

    type_name = "core-metrics-extractor"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.default_engine = params.str("defaultEngine", "vllm", choices=SUPPORTED_ENGINES)
        if params.str("engineLabelKey", None) is not None:
            raise ConfigError(f"plugin {name!r}: parameter 'engineLabelKey' is not supported: every endpoint is "
                              f"read as {SUPPORTED_ENGINES[0]} (no per-pod engine label)")
        if params.list("engineConfigs", None) is not None:
            raise ConfigError(f"plugin {name!r}: parameter 'engineConfigs' is not supported; "
                              f"supported engines: {list(SUPPORTED_ENGINES)}")

    def describe(self) -> str:
        return f"defaultEngine={self.default_engine}"


class EndpointNotificationSource(Plugin):
    """Endpoint add/remove events to producers (always on: producers follow the pool's endpoints)."""

    type_name = "endpoint-notification-source"
