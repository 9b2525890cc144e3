"""context-length-aware: route prompts to the endpoints whose context-length range fits them (llm-d).

Each endpoint may carry a label (default `llm-d.ai/context-length-range`) `"min-max"` in tokens.
Scores: in range, above 0.3 and up to 1, higher for a tighter range and for more room left above
the prompt; out of range, below 0.3 and closer to 0.3 the nearer the range; no label, 0.5; a label
that does not parse, 0. With `enableFiltering`, endpoints out of range (or with a bad label) are
also filtered out; endpoints without the label stay. The prompt length is the token-producer's
token count when there is one, else a quarter of the prompt's characters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.framework import (
    PROMPT_TOKENS,
    ConfigError,
    CycleState,
    Endpoint,
    Filter,
    InferenceRequest,
    PluginContext,
    PluginParams,
    PromptTokens,
    Scorer,
)
from epp.scorers.prompt_text import user_input_length

DEFAULT_LABEL = "llm-d.ai/context-length-range"
NO_LABEL_SCORE = 0.5
OUT_OF_RANGE_CEILING = 0.3  # every in-range score is above it, every out-of-range score below
CHARACTERS_PER_TOKEN = 4


def parse_range(text: str) -> tuple[int, int] | None:
    """`"min-max"` as (min, max), or None when it is not two non-negative integers with min <= max."""
    low, sep, high = text.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        return None
    lo, hi = int(low), int(high)
    return (lo, hi) if lo <= hi else None


def range_score(length: int, lo: int, hi: int) -> float:
    """How well a `[lo, hi]` range suits a prompt of `length` tokens."""
    if lo <= length <= hi:
        width = hi - lo
        if width == 0:
            return 1.0
        tightness = 1.0 / (1.0 + width / 10_000)  # a specialised endpoint before a generalist
        headroom = (hi - length) / width  # room left for the answer
        return OUT_OF_RANGE_CEILING + (1.0 - OUT_OF_RANGE_CEILING) * (0.7 * tightness + 0.3 * headroom)
    distance = length - hi if length > hi else lo - length
    return OUT_OF_RANGE_CEILING / (1.0 + distance / 1000)


class ContextLengthAware(Filter, Scorer):
    """Prefers (with `enableFiltering`, keeps only) endpoints whose context-length range label fits the prompt."""

    type_name = "context-length-aware"

    def __init__(self, name: str, params: PluginParams, context: PluginContext) -> None:
        super().__init__(name)
        self.label = params.str("label", DEFAULT_LABEL) or ""
        if not self.label:
            raise ConfigError(f"plugin {name!r}: parameter 'label' must be a label key")
        self.enable_filtering = params.bool("enableFiltering", False)
        if params.str("reusableTokensProducerName", None) is not None:
            raise ConfigError(f"plugin {name!r}: parameter 'reusableTokensProducerName' is not supported: there is "
                              "no p2p-source-producer here")

    def describe(self) -> str:
        return f"label={self.label} enableFiltering={str(self.enable_filtering).lower()}"

    @staticmethod
    def prompt_length(state: CycleState, request: InferenceRequest) -> int:
        """The prompt's tokens: counted by a token-producer, else estimated from its characters."""
        tokens: PromptTokens | None = state.get(PROMPT_TOKENS)
        if tokens is not None:
            return len(tokens.token_ids)
        return user_input_length(request) // CHARACTERS_PER_TOKEN

    def filter(self, state: CycleState, request: InferenceRequest,
               endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        if not self.enable_filtering:
            return list(endpoints)
        length = self.prompt_length(state, request)
        kept = []
        for ep in endpoints:
            text = ep.labels.get(self.label)
            bounds = parse_range(text) if text is not None else None
            if text is None or (bounds is not None and bounds[0] <= length <= bounds[1]):
                kept.append(ep)
        return kept

    def score(self, state: CycleState, request: InferenceRequest,
              endpoints: Sequence[Endpoint]) -> Mapping[str, float]:
        length = self.prompt_length(state, request)
        out: dict[str, float] = {}
        for ep in endpoints:
            text = ep.labels.get(self.label)
            if text is None:
                out[ep.name] = NO_LABEL_SCORE
                continue
            bounds = parse_range(text)
            out[ep.name] = range_score(length, *bounds) if bounds is not None else 0.0
        return out
