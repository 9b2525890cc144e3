"""Requests as the built-in parsers read them, for tests that build an `InferenceRequest` by hand.

A request's prompt is read through its `format` (its API's parser): a test that builds one
without the picker's parsing gives it the format of its API with `format_of`.
"""

from __future__ import annotations

from epp.framework import RequestFormat
from epp.scorers.parsers.anthropic import AnthropicParser
from epp.scorers.parsers.passthrough import PassthroughParser
from epp.scorers.parsers.sglanghttp import SGLangHttpParser
from epp.scorers.parsers.vllmhttp import VllmHttpParser

# One instance each (no metrics registry): formats hold no per-request state.
VLLM_HTTP = VllmHttpParser()  # every OpenAI path and vLLM's generate
ANTHROPIC = AnthropicParser()
SGLANG = SGLangHttpParser()
PASSTHROUGH = PassthroughParser()


def format_of(api: str) -> RequestFormat:
    """The built-in format that reads `api` (the API names the parsers give requests)."""
    if api in ("messages", "messages/count_tokens"):
        return ANTHROPIC
    if api == "passthrough":
        return PASSTHROUGH
    return VLLM_HTTP
