"""An outside scorer package for the LLM endpoint picker: `kv-headroom-scorer`."""

from epp.framework import PluginRegistry
from epp_kv_headroom.scorer import KVHeadroomScorer

__all__ = ["KVHeadroomScorer", "register"]


def register(registry: PluginRegistry) -> None:
    """Entry point of group `epp.plugins`: make `kv-headroom-scorer` available to configs."""
    registry.register_class(KVHeadroomScorer)
