"""Merges the Prometheus text pages of several worker processes into the one page the pod serves."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Counters and histograms add up across workers. A gauge is one process's state (open streams,
# an endpoint's scrape age): it is kept per worker under this label, like prometheus_client's
# multiprocess mode does with its `pid` label, so nothing is averaged away.
WORKER_LABEL = "worker"


@dataclass
class _Family:
    help_line: str = ""
    type_name: str = "untyped"
    # (sample name, label text) -> value, in first-seen order
    samples: dict[tuple[str, str], float] = field(default_factory=dict)


def _split_sample(line: str) -> tuple[str, str, float] | None:
    """`name{labels} value` -> (name, label text without braces, value); None for a line that is no sample."""
    if "{" in line:
        name, _, rest = line.partition("{")
        labels, sep, value_text = rest.rpartition("}")
        if not sep:
            return None
    else:
        name, _, value_text = line.partition(" ")
        labels = ""
    parts = value_text.split()
    if not parts:
        return None
    try:
        return name.strip(), labels, float(parts[0])
    except ValueError:
        return None


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(value) if value != int(value) or abs(value) >= 1e16 else f"{int(value)}.0"


def merge_pages(pages: Sequence[tuple[str, str]]) -> str:
    """Merge `(worker id, exposition text)` pages: counters, histograms and summaries summed, gauges
    kept per worker with a `worker` label (`*_created` timestamps: the earliest)."""
    families: dict[str, _Family] = {}
    for worker, page in pages:
        current: _Family | None = None
        family_name = ""
        for line in page.splitlines():
            if not line:
                continue
            if line.startswith("# HELP "):
                family_name = line[7:].split(" ", 1)[0]
                current = families.setdefault(family_name, _Family())
                current.help_line = current.help_line or line
                continue
            if line.startswith("# TYPE "):
                name, _, type_name = line[7:].partition(" ")
                family_name = name
                current = families.setdefault(family_name, _Family())
                current.type_name = type_name.strip() or "untyped"
                continue
            if line.startswith("#"):
                continue
            sample = _split_sample(line)
            if sample is None:
                continue
            name, labels, value = sample
            if current is None or not name.startswith(family_name):
                family_name = name
                current = families.setdefault(name, _Family())
            if current.type_name == "gauge" and not family_name.endswith("_created"):
                labels = f'{labels},{WORKER_LABEL}="{worker}"' if labels else f'{WORKER_LABEL}="{worker}"'
                current.samples[(name, labels)] = value
                continue
            key = (name, labels)
            if key not in current.samples:
                current.samples[key] = value
            elif family_name.endswith("_created"):
                current.samples[key] = min(current.samples[key], value)
            else:
                current.samples[key] += value
    out: list[str] = []
    for name, family in families.items():
        if family.help_line:
            out.append(family.help_line)
        out.append(f"# TYPE {name} {family.type_name}")
        for (sample_name, labels), value in family.samples.items():
            label_text = f"{{{labels}}}" if labels else ""
            out.append(f"{sample_name}{label_text} {_format_value(value)}")
    return "\n".join(out) + "\n"
