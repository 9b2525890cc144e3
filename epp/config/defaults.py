"""What the loader supplies when a config leaves it out (GIE's defaults)."""

from __future__ import annotations

from epp.config.schema import API_VERSION, KIND

DEFAULT_SCORER_WEIGHT = 1.0
DEFAULT_PROFILE_NAME = "default"
DEFAULT_PICKER_TYPE = "max-score-picker"
DEFAULT_PROFILE_HANDLER_TYPE = "single-profile-handler"
DEFAULT_SATURATION_DETECTOR_TYPE = "utilization-detector"
DEFAULT_PARSER_TYPE = "openai-parser"

# GIE's built-in default (`loadDefaultConfig`): used when no config is given.
DEFAULT_CONFIG_YAML = f"""\
apiVersion: {API_VERSION}
kind: {KIND}
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors:
    - pluginRef: core-metrics-extractor
"""
