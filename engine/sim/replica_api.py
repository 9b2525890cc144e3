"""What the API modules of a simulated replica use of it (`SimReplica` in `server.py` is one).

A protocol of its own, so that the API modules (`responses_api.py`, `anthropic_api.py`,
`embeddings_api.py`, `token_apis.py`) depend on what they use and not on the server that mounts them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from epp.engine.sim.engine import SimEngine, SimRequest
from epp.engine.sim.pd import PDSupport
from epp.engine.sim.replica_config import ReplicaConfig
from epp.engine.sim.request_parsing import RequestReader
from epp.engine.sim.tokenizer import SimTokenizer


class Replica(Protocol):
    """One simulated replica as its API routes see it."""

    config: ReplicaConfig
    requests: RequestReader
    engine: SimEngine
    pd: PDSupport
    tokenizer: SimTokenizer

    def text_of(self, ids: list[int]) -> str:
        """The text of generated token ids."""

    def natural_len(self, prompt_ids: list[int]) -> int:
        """How many tokens a chat-like request generates unless its limit stops it first."""

    def cached_usage(self, r: SimRequest) -> tuple[int, int]:
        """(prompt tokens found in the prefix cache, full prompt blocks' tokens the request added to it)."""

    def generate(self, r: SimRequest) -> AsyncIterator[list[int]]:
        """Run `r` and yield its new output tokens until it finishes."""
