"""Data-layer and parser plugin types of GIE configs: validated, so existing configs load unchanged.

Our scraper reads vLLM `/metrics` itself; these plugins carry the settings a GIE config gives
(`scheme`, `path`, engine) for the data layer to read from `LoadedConfig.data_sources`.
"""

from __future__ import annotations

from epp.framework import ConfigError, Plugin, PluginContext, PluginParams

SUPPORTED_ENGINES = ("vllm",)


class MetricsDataSource(Plugin):
    """Where model-server metrics are scraped: `scheme` (http|https), `path` (/metrics), `insecureSkipVerify`."""

    type_name = "metrics-data-source"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.scheme = params.str("scheme", "http", choices=("http", "https"))
        self.path = params.str("path", "/metrics") or "/metrics"
        if not self.path.startswith("/"):
            raise ConfigError(f"plugin {name!r}: parameter 'path' must start with '/', got {self.path!r}")
        self.insecure_skip_verify = params.bool("insecureSkipVerify", False)

    def describe(self) -> str:
        return f"scheme={self.scheme} path={self.path} insecureSkipVerify={str(self.insecure_skip_verify).lower()}"


class CoreMetricsExtractor(Plugin):
    """Which metric series are read: the vLLM engine mapping (`engineLabelKey`, `defaultEngine`)."""

    type_name = "core-metrics-extractor"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.engine_label_key = params.str("engineLabelKey", "inference.networking.k8s.io/engine-type")
        self.default_engine = params.str("defaultEngine", "vllm", choices=SUPPORTED_ENGINES)
        if params.list("engineConfigs", None):
            raise ConfigError(f"plugin {name!r}: parameter 'engineConfigs' is not supported; "
                              f"supported engines: {list(SUPPORTED_ENGINES)}")

    def describe(self) -> str:
        return f"engineLabelKey={self.engine_label_key} defaultEngine={self.default_engine}"


class OpenAIParser(Plugin):
    """The OpenAI request parser (completions, chat, responses, conversations, embeddings by path)."""

    type_name = "openai-parser"
