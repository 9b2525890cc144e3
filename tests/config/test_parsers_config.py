"""`requestHandler.parsers`: the parser chain a config builds, in order, as llm-d reads it."""

from __future__ import annotations

import json

import pytest

from epp.config import describe, load_config_text
from epp.framework import ConfigError
from epp.framework.registry import default_registry
from epp.request.parsing import RequestParser

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
BARE = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
"""


def load(text: str):
    return load_config_text(text, source="epp.yaml", registry=default_registry())


def api_of(loaded, path: str, body: dict) -> tuple[str, str]:
    """(parser type, API) a request on `path` is read by with this config's chain."""
    reader = RequestParser(parsers=loaded.parsers)
    request, _ = reader.parse(request_id="r", headers={":path": path}, body=json.dumps(body).encode(),
                              subset_hint=None)
    return request.format.type_name, request.api


def test_llm_d_parsers_load_in_order_and_check_config_says_how_each_maps():
    loaded = load(CONFIG)
    assert [p.type_name for p in loaded.parsers] == ["openai-parser", "anthropic-parser", "passthrough-parser"]
    text = describe(loaded)
    assert ("anthropic-parser: llm-d anthropic-parser -> anthropic-parser: Anthropic Messages (/v1/messages) and "
            "/v1/messages/count_tokens") in text
    assert "parsers (asked in order; a path goes to the first that claims it): openai-parser, anthropic-parser, " \
           "passthrough-parser" in text


def test_no_parsers_listed_is_llm_ds_default_chain_auto_created():
    loaded = load(BARE)
    assert [p.type_name for p in loaded.parsers] == ["openai-parser", "anthropic-parser", "vllmhttp-parser",
                                                     "passthrough-parser"]
    entry = next(e for e in loaded.plugins if e.type_name == "vllmhttp-parser")
    assert entry.auto_created == "llm-d's default parser chain (requestHandler.parsers)"
    assert api_of(loaded, "/inference/v1/generate", {"token_ids": [1, 2, 3]}) == ("vllmhttp-parser", "generate")
    assert api_of(loaded, "/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "x"}]}) \
        == ("anthropic-parser", "messages/count_tokens")


def test_a_configured_parser_of_a_default_type_is_the_one_the_default_chain_uses():
    loaded = load(BARE + "- type: openai-parser\n  parameters: {responseAffinityCapacity: 7}\n")
    assert loaded.parsers[0] is loaded.plugin("openai-parser")
    assert loaded.parsers[0].responses.capacity == 7


def test_a_parser_left_out_of_the_chain_reads_nothing_and_its_paths_pass_through():
    # Only Anthropic's parser: OpenAI paths go to the passthrough fallback added last (and noted).
    loaded = load(CONFIG.replace("{pluginRef: openai-parser}, ", ""))
    assert [p.type_name for p in loaded.parsers] == ["anthropic-parser", "passthrough-parser"]
    assert api_of(loaded, "/v1/completions", {"model": "m", "prompt": "hi"}) == ("passthrough-parser", "passthrough")
    alone = load(BARE + "- type: anthropic-parser\nrequestHandler: {parsers: [{pluginRef: anthropic-parser}]}\n")
    assert [p.type_name for p in alone.parsers] == ["anthropic-parser", "passthrough-parser"]
    assert any(note.startswith("requestHandler.parsers: no fallback parser listed") for note in alone.notes)


def test_the_order_decides_which_parser_reads_a_path_both_claim():
    both = BARE + ("- type: openai-parser\n- type: vllmhttp-parser\n"
                   "requestHandler: {parsers: [{pluginRef: vllmhttp-parser}, {pluginRef: openai-parser}]}\n")
    assert api_of(load(both), "/v1/completions", {"model": "m", "prompt": "p"}) == ("vllmhttp-parser", "completions")
    swapped = both.replace("[{pluginRef: vllmhttp-parser}, {pluginRef: openai-parser}]",
                           "[{pluginRef: openai-parser}, {pluginRef: vllmhttp-parser}]")
    assert api_of(load(swapped), "/v1/completions", {"model": "m", "prompt": "p"}) == ("openai-parser", "completions")


def test_sglang_claims_its_own_generate_path_only():
    loaded = load(BARE + "- type: sglanghttp-parser\n- type: vllmhttp-parser\nrequestHandler: {parsers: "
                         "[{pluginRef: sglanghttp-parser}, {pluginRef: vllmhttp-parser}]}\n")
    assert api_of(loaded, "/generate", {"input_ids": [1, 2]}) == ("sglanghttp-parser", "generate")
    assert api_of(loaded, "/inference/v1/generate", {"token_ids": [1, 2]}) == ("vllmhttp-parser", "generate")


@pytest.mark.parametrize("section, message", [
    ("requestHandler: {parsers: [{pluginRef: random-picker}]}",
     "epp.yaml: requestHandler.parsers[0].pluginRef: plugin 'random-picker' has type random-picker, which is not a "
     "request parser; parser types: anthropic-parser, openai-parser, passthrough-parser, sglanghttp-parser, "
     "vllmhttp-parser"),
    ("requestHandler: {parsers: [{pluginRef: nope}]}",
     "epp.yaml: requestHandler.parsers[0].pluginRef: unknown plugin 'nope'"),
    ("requestHandler: {parsers: [{name: x}]}", "epp.yaml: requestHandler.parsers[0]"),
])
def test_a_bad_chain_is_refused_naming_the_field(section, message):
    with pytest.raises(ConfigError) as err:
        load(BARE + section + "\n")
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("type_name, use", [("vllmgrpc-parser", "use vllmhttp-parser"),
                                             ("vertexai-parser", "use openai-parser")])
def test_the_grpc_parsers_are_refused_with_what_to_use(type_name, use):
    with pytest.raises(ConfigError, match=use):
        load(BARE + f"- type: {type_name}\n")


def test_the_parser_parameters_are_checked():
    with pytest.raises(ConfigError, match="responseAffinityTTL"):
        load(BARE + "- type: openai-parser\n  parameters: {responseAffinityTTL: 0s}\n")


def test_a_single_request_handler_parser_as_llm_ds_docs_show_it_is_a_chain_of_one():
    loaded = load(BARE + "- type: vllmhttp-parser\nrequestHandler:\n  parser: {pluginRef: vllmhttp-parser}\n")
    assert [p.type_name for p in loaded.parsers] == ["vllmhttp-parser", "passthrough-parser"]
    assert "requestHandler.parser: read as requestHandler.parsers: [it] (llm-d's decoder knows only parsers)" \
        in loaded.notes
    with pytest.raises(ConfigError, match="not both"):
        load(BARE + "- type: vllmhttp-parser\nrequestHandler:\n  parser: {pluginRef: vllmhttp-parser}\n"
                    "  parsers: [{pluginRef: vllmhttp-parser}]\n")
