"""Loading and checking the GIE `EndpointPickerConfig` into a ready scheduling pipeline."""

from epp.config.compose import DEFAULT_CONFIG_YAML
from epp.config.loader import (
    API_VERSION,
    KIND,
    KNOWN_FEATURE_GATES,
    DataSourceConfig,
    LoadedConfig,
    PluginEntry,
    describe,
    load_config,
    load_config_text,
    load_default_config,
)

__all__ = [
    "API_VERSION", "DEFAULT_CONFIG_YAML", "KIND", "KNOWN_FEATURE_GATES", "DataSourceConfig", "LoadedConfig",
    "PluginEntry", "describe", "load_config", "load_config_text", "load_default_config",
]
