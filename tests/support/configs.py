"""EndpointPickerConfig documents the tests share, written through `epp.config.compose` (no YAML spelt out)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from epp.config.compose import PluginDef, endpoint_picker_config, plugin

SAMPLE_CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"

# GIE's integration-test scorers (test/integration/epp/testdata/default-config.yaml), all at weight 1.
GIE_TEST_SCORERS = ("queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "lora-affinity-scorer")


# Approximate prefix routing with the load scorers: what the hostile-input tests run the picker with.
PREFIX_SCORERS = ("prefix-home-scorer", "queue-scorer", "kv-cache-utilization-scorer", "max-score-picker")
PREFIX_CONFIG = endpoint_picker_config(["approx-prefix-cache-producer", "prefix-cache-scorer", *PREFIX_SCORERS],
                                       {"prefix-cache-scorer": 3, **dict.fromkeys(PREFIX_SCORERS)})


def scorer_then_max_score(producer: PluginDef | None, scorer: str = "prefix-cache-scorer") -> str:
    """One scorer and the max-score picker, after an optional data producer (`plugin(...)` entry)."""
    plugins = [producer] if producer is not None else []
    return endpoint_picker_config([*plugins, scorer, "max-score-picker"], [scorer, "max-score-picker"])


def gie_test_config(**sections: Any) -> str:
    """GIE's integration-test config: queue, kv-cache-utilization, prefix and lora-affinity at weight 1,
    max-score picker; `sections` adds top-level fields (objectives, ...)."""
    return endpoint_picker_config([*GIE_TEST_SCORERS, "max-score-picker"], [*GIE_TEST_SCORERS, "max-score-picker"],
                                  **sections)


def objectives(**priorities: int) -> list[dict[str, Any]]:
    """The `objectives` section: objective name -> priority (negative: sheddable)."""
    return [{"name": name, "priority": priority} for name, priority in priorities.items()]


def sample_config(name: str) -> dict[str, Any]:
    """The document of the sample config examples/configs/<name>.yaml, for a test to edit."""
    return yaml.safe_load((SAMPLE_CONFIGS / f"{name}.yaml").read_text())


def as_yaml(document: Mapping[str, Any]) -> str:
    """An EndpointPickerConfig document (e.g. an edited `sample_config`) as YAML text again."""
    sections = dict(document)
    return endpoint_picker_config(sections.pop("plugins"), **sections)


def pd_config(threshold: int = 512, *first_plugins: PluginDef) -> str:
    """The P/D sample (examples/configs/pd.yaml) with this handler threshold and `first_plugins` ahead of its own."""
    document = sample_config("pd")
    handler = next(p for p in document["plugins"] if p["type"] == "pd-profile-handler")
    handler["parameters"]["threshold"] = threshold
    document["plugins"][:0] = first_plugins
    return as_yaml(document)


__all__ = ["GIE_TEST_SCORERS", "PREFIX_CONFIG", "PREFIX_SCORERS", "SAMPLE_CONFIGS", "as_yaml", "endpoint_picker_config",
           "gie_test_config", "objectives", "scorer_then_max_score", "pd_config", "plugin", "sample_config"]
