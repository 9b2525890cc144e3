"""EndpointPickerConfig documents the tests share, written through `epp.config.compose` (no YAML spelt out)."""

from __future__ import annotations

from typing import Any

from epp.config.compose import endpoint_picker_config, plugin

# GIE's integration-test scorers (test/integration/epp/testdata/default-config.yaml), all at weight 1.
GIE_TEST_SCORERS = ("queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "lora-affinity-scorer")


def gie_test_config(**sections: Any) -> str:
    """GIE's integration-test config: queue, kv-cache-utilization, prefix and lora-affinity at weight 1,
    max-score picker; `sections` adds top-level fields (objectives, ...)."""
    return endpoint_picker_config([*GIE_TEST_SCORERS, "max-score-picker"], [*GIE_TEST_SCORERS, "max-score-picker"],
                                  **sections)


def objectives(**priorities: int) -> list[dict[str, Any]]:
    """The `objectives` section: objective name -> priority (negative: sheddable)."""
    return [{"name": name, "priority": priority} for name, priority in priorities.items()]


__all__ = ["GIE_TEST_SCORERS", "endpoint_picker_config", "gie_test_config", "objectives", "plugin"]
