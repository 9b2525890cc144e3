"""Sharing what a picker learns from its own decisions with the other pickers of its pool.

Several pickers (worker processes, pods) route one pool. What each learns from the replicas
(metrics, KV events) they all see alike; what each learns from its own picks (which endpoint
was sent which prompt prefix) only it knows, unless it shares it. A plugin publishes such
decisions through `PluginContext.sharing` and registers how to apply its peers' ones; the server decides how they travel
(`epp.peer`: a versioned gRPC protocol in `proto/`). With no peers configured it is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from epp.framework.types import EndpointMetrics

#: Applies a peer's route: (endpoint, block hashes first block first, LRU capacity in blocks).
PrefixLearner = Callable[[str, Sequence[int], int], None]
#: Lists what this picker knows, for a peer that starts late: (endpoint, hashes oldest first, capacity).
PrefixSnapshotter = Callable[[], Iterable[tuple[str, Sequence[int], int]]]
#: Applies a peer's precise claim: (endpoint, block keys first block first).
ClaimLearner = Callable[[str, Sequence[int]], None]
#: Applies a prompt a peer saw counted: (characters, prompt tokens the model server counted).
PromptTokensLearner = Callable[[int, int], None]
#: Applies a peer's scrape of an endpoint: (endpoint, its metrics, seconds since the page was read).
LoadLearner = Callable[[str, EndpointMetrics, float], None]


class DecisionSharing:
    """The picker's link to its peers; this base class has no peers (every call does nothing)."""

    def publish_prefix(self, endpoint: str, hashes: Sequence[int], capacity: int) -> None:
        """Tell the peers that `endpoint` was sent a request with these prefix block hashes."""

    def share_prefixes(self, learner: PrefixLearner, snapshotter: PrefixSnapshotter) -> None:
        """Register how to apply the peers' prefix routes and how to list this picker's for a late peer."""

    def publish_claim(self, endpoint: str, keys: Sequence[int]) -> None:
        """Tell the peers that `endpoint` was sent a request with these precise block keys (not yet in events)."""

    def share_claims(self, learner: ClaimLearner) -> None:
        """Register how to apply the peers' precise claims."""

    def publish_prompt_tokens(self, characters: int, tokens: int) -> None:
        """Tell the peers that a prompt of `characters` characters was counted as `tokens` tokens."""

    def share_prompt_tokens(self, learner: PromptTokensLearner) -> None:
        """Register how to apply the prompt token counts the peers saw."""

    def scrapes(self, endpoint: str) -> bool:
        """Whether this picker scrapes `endpoint` itself (with peers, one of them does and shares it)."""
        return True

    def publish_load(self, endpoint: str, metrics: EndpointMetrics) -> None:
        """Tell the peers what this picker's scrape of `endpoint` read."""

    def share_loads(self, learner: LoadLearner) -> None:
        """Register how to apply the peers' scrapes."""

    @property
    def has_peers(self) -> bool:
        """Whether any peer is configured (plugins may skip building what they would publish)."""
        return False
