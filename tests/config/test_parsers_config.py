"""llm-d's `requestHandler.parsers` with `anthropic-parser`, as operators paste it."""

from __future__ import annotations

import pytest

from epp.config import describe, load_config_text
from epp.framework import ConfigError
from epp.framework.registry import default_registry

CONFIG = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: openai-parser
- type: anthropic-parser
- type: passthrough-parser
- type: random-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: random-picker}]
requestHandler:
  parsers: [{pluginRef: openai-parser}, {pluginRef: anthropic-parser}, {pluginRef: passthrough-parser}]
"""


def load(text: str):
    return load_config_text(text, source="epp.yaml", registry=default_registry())


def test_llm_d_default_parsers_load_and_check_config_says_how_anthropic_parser_maps():
    text = describe(load(CONFIG))
    assert "anthropic-parser: llm-d anthropic-parser -> anthropic-parser: Anthropic Messages (/v1/messages)" in text


def test_anthropic_parser_alone_still_needs_openai_parser_listed():
    alone = CONFIG.replace("{pluginRef: openai-parser}, ", "")
    with pytest.raises(ConfigError, match="list openai-parser among the parsers"):
        load(alone)
