"""The pick's scores in Envoy dynamic metadata (`epp serve --emit-endpoint-scores`).

llm-d's router writes them under `envoy.lb` / `x-gateway-destination-endpoint-scores`; its value
format is not documented, so ours is compact JSON in a string, one object per profile that ran,
its endpoints best first (among equal scores, the picked one first):

    {"default":{"10.0.0.2:8000":4.5,"10.0.0.1:8000":2.25}}

With `--emit-endpoint-scores=scorers` each endpoint also has each scorer's score (before its
weight, clamped into [0, 1] as the scheduler counts it):

    {"default":{"10.0.0.2:8000":{"total":4.5,"scorers":{"queue-scorer":1,"prefix-cache-scorer":0.833}}}}

Bounded: at most `MAX_ENDPOINTS` endpoints per profile (the picked ones always among them) and
`MAX_VALUE_BYTES` bytes in all; past the byte cap the lowest-scored unpicked endpoints are left out.

Built per request while emitting, so the text is put together directly rather than through a
dict and `json.dumps` (a third of the cost): endpoint names are `ip:port`, and profile and scorer
names are JSON-quoted with non-ASCII escaped, so the value is ASCII and its length is its bytes.
"""

from __future__ import annotations

import json
import math
from operator import attrgetter

from epp.framework.plugin import CycleState, ScoredEndpoint, clamp_score
from epp.framework.scheduler import ProfileTrace, ScheduleTrace, score_trace

ENDPOINT_SCORES_KEY = "x-gateway-destination-endpoint-scores"
MAX_ENDPOINTS = 10
MAX_VALUE_BYTES = 4096
# Digits after the point: scores are in [0, 1] times a weight; more would only add bytes.
_DIGITS = 4
_BY_SCORE = attrgetter("score")


def _quoted(name: str) -> str:
    """A profile or scorer name as a JSON string, non-ASCII escaped (names are plain: quoted directly)."""
    if name.isascii() and name.isprintable() and '"' not in name and "\\" not in name:
        return f'"{name}"'
    return json.dumps(name)


def _number(value: float) -> str:
    """A score as JSON (a weight of inf or NaN in a config makes totals so: null)."""
    return repr(round(value, _DIGITS)) if math.isfinite(value) else "null"


def _ranked(profile: ProfileTrace) -> list[tuple[ScoredEndpoint, bool]]:
    """The endpoints to show, best first and among equals the picked first, each with whether it was picked.

    The picked ones are always shown, the best others fill up to `MAX_ENDPOINTS`.
    """
    ordered = sorted(profile.totals, key=_BY_SCORE, reverse=True)  # stable: ties keep candidate order
    picked = {ep.name for ep in profile.picked}
    for i, scored in enumerate(ordered):
        if scored.endpoint.name in picked:  # move it to the front of its tie
            j = i
            while j > 0 and ordered[j - 1].score == scored.score and ordered[j - 1].endpoint.name not in picked:
                j -= 1
            ordered.insert(j, ordered.pop(i))
    shown, others = [], MAX_ENDPOINTS - len(picked)
    for scored in ordered:
        if scored.endpoint.name in picked:
            shown.append((scored, True))
        elif others > 0:
            shown.append((scored, False))
            others -= 1
    return shown


def _entry(profile: ProfileTrace, scored: ScoredEndpoint) -> str:
    name = scored.endpoint.name
    if not profile.detailed:
        return f'"{name}":{_number(scored.score)}'
    scorers = ",".join(f"{_quoted(ws.scorer.name)}:{_number(clamp_score(scores.get(name, 0.0)))}"
                       for ws, scores in profile.scores)
    return f'"{name}":{{"total":{_number(scored.score)},"scorers":{{{scorers}}}}}'


def _joined(parts: dict[str, list[tuple[str, bool]]]) -> str:
    return "{" + ",".join(f"{_quoted(name)}:{{{','.join(text for text, _ in entries)}}}"
                          for name, entries in parts.items()) + "}"


def endpoint_scores_value(trace: ScheduleTrace) -> str:
    """The metadata value for one cycle's trace (format and bounds: module docstring)."""
    parts = {name: [(_entry(profile, scored), was_picked) for scored, was_picked in _ranked(profile)]
             for name, profile in trace.profiles.items()}
    value = _joined(parts)
    while len(value) > MAX_VALUE_BYTES:  # ASCII: characters are bytes
        # Drop the lowest-scored endpoint that was not picked, from the profile showing the most.
        droppable = [(len(entries), name) for name, entries in parts.items()
                     if any(not was_picked for _, was_picked in entries)]
        if not droppable:
            return "{}"
        entries = parts[max(droppable)[1]]
        del entries[max(i for i, (_, was_picked) in enumerate(entries) if not was_picked)]
        value = _joined(parts)
    return value


def endpoint_scores_of(state: CycleState) -> str | None:
    """The request's recorded scores as the metadata value, or None when none were recorded."""
    trace = score_trace(state)
    return endpoint_scores_value(trace) if trace is not None and trace.profiles else None
