"""Loading and checking the GIE `EndpointPickerConfig` into the runtime pipeline the director runs."""

from epp.config.compose import DEFAULT_CONFIG_YAML
from epp.config.describe import describe
from epp.config.loader import load_config, load_config_or_default, load_config_text, load_default_config
from epp.config.schema import API_VERSION, KIND, KNOWN_FEATURE_GATES
from epp.requestcontrol.pipeline import DataSourceConfig, LoadedConfig, PluginEntry

__all__ = [
    "API_VERSION", "DEFAULT_CONFIG_YAML", "KIND", "KNOWN_FEATURE_GATES", "DataSourceConfig", "LoadedConfig",
    "PluginEntry", "describe", "load_config", "load_config_or_default", "load_config_text", "load_default_config",
]
