"""The request parsers: one module per API format, each registered as its llm-d `*-parser` plugin type.

Written only against `epp.framework`, like every built-in plugin, so a parser from an outside
package (an `epp.plugins` entry point; see examples/outside_parser) has exactly the API these
have. A new format is one module with a `Parser` subclass and one line in `register` (or in its
own package's entry point).

| type | module | paths |
|---|---|---|
| `openai-parser` | openai.py | `/conversations`, `/responses`, `/chat/completions`, `/completions`, |
| | | `/embeddings`, `/rerank` |
| `anthropic-parser` | anthropic.py | `/messages/count_tokens`, `/messages` |
| `vllmhttp-parser` | vllmhttp.py | `/inference/v1/generate`, then every path of `openai-parser` |
| `sglanghttp-parser` | sglanghttp.py | `/generate` |
| `passthrough-parser` | passthrough.py | none: the fallback for unclaimed paths |
"""

from epp.framework import PluginRegistry


def register(registry: PluginRegistry) -> None:
    """Entry point of the `epp.plugins` group: registers the built-in parsers."""
    from epp.scorers.parsers import anthropic, openai, passthrough, sglanghttp, vllmhttp

    for cls in (openai.OpenAIParser, anthropic.AnthropicParser, vllmhttp.VllmHttpParser,
                sglanghttp.SGLangHttpParser, passthrough.PassthroughParser):
        registry.register_class(cls)
