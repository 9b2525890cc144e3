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
"""

from __future__ import annotations

import json
import math
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.framework.plugin import CycleState, clamp_score
from epp.framework.scheduler import ProfileTrace, ScheduleTrace, score_trace
from epp.server.messages import set_lb_metadata

ENDPOINT_SCORES_KEY = "x-gateway-destination-endpoint-scores"
MAX_ENDPOINTS = 10
MAX_VALUE_BYTES = 4096
# Digits after the point: scores are in [0, 1] times a weight; more would only add bytes.
_DIGITS = 4


def _ranked(profile: ProfileTrace) -> list[Any]:
    """The profile's scored endpoints to show, best first (of equals, the picked first): the picked, then the best others."""
    picked = {ep.name for ep in profile.picked}
    ordered = sorted(profile.totals, key=lambda s: (-s.score, s.endpoint.name not in picked))
    others = [s for s in ordered if s.endpoint.name not in picked][:max(0, MAX_ENDPOINTS - len(picked))]
    shown = {s.endpoint.name for s in others} | picked
    return [s for s in ordered if s.endpoint.name in shown]


def _number(value: float) -> float | None:
    """A score as JSON can hold it (a weight of inf or NaN in a config makes totals so)."""
    return round(value, _DIGITS) if math.isfinite(value) else None


def _entry(profile: ProfileTrace, name: str, total: float) -> Any:
    if not profile.detailed:
        return _number(total)
    scorers = {ws.scorer.name: _number(clamp_score(scores.get(name, 0.0))) for ws, scores in profile.scores}
    return {"total": _number(total), "scorers": scorers}


def endpoint_scores_value(trace: ScheduleTrace) -> str:
    """The metadata value for one cycle's trace (format and bounds: module docstring)."""
    shown = {name: _ranked(profile) for name, profile in trace.profiles.items()}
    picked = {name: {ep.name for ep in profile.picked} for name, profile in trace.profiles.items()}
    while True:
        value = json.dumps({name: {s.endpoint.name: _entry(trace.profiles[name], s.endpoint.name, s.score)
                                   for s in scored} for name, scored in shown.items()},
                           separators=(",", ":"))
        if len(value.encode()) <= MAX_VALUE_BYTES:
            return value
        # Drop the lowest-scored endpoint that was not picked, from the profile showing the most.
        unpicked = {name: [i for i, s in enumerate(scored) if s.endpoint.name not in picked[name]]
                    for name, scored in shown.items()}
        droppable = [(len(shown[name]), name) for name, indexes in unpicked.items() if indexes]
        if not droppable:
            return "{}"
        _, name = max(droppable)
        del shown[name][unpicked[name][-1]]


def add_endpoint_scores(response: pb.ProcessingResponse, state: CycleState) -> None:
    """Put the request's recorded scores into the headers reply (nothing when none were recorded)."""
    trace = score_trace(state)
    if trace is not None and trace.profiles:
        set_lb_metadata(response, ENDPOINT_SCORES_KEY, endpoint_scores_value(trace))
