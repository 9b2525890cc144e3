"""`POST /debug/explain`: how the running picker would route one request, without routing it.

The request is parsed by the picker's own parser and run through the director's own stages
(`epp.requestcontrol.director.STAGES`, the same code in the same order as a real request: candidates,
admitters that read no data, data producers, admitters that read data, the scheduler) against the
picker's current view, with the stages that have side effects skipped and named as such: flow-control
queueing, capacity gates (a gate may wake a sleeping replica), pre-request hooks (the prefix index
insert, the session binding, the speculative KV claim), the in-flight booking. No plugin latency
metric is observed. What a data producer keeps as a cache (tokenizations) or learns from any prompt it
hashes may still change. Unlike a real request, every admitter runs after a refusal, and the scheduler
too, so the answer shows where the request would have gone.

Pickers that choose at random (ties, `random-picker`, `weighted-random-picker`) may choose
differently for the real request; the answer says how many endpoints tie at the top.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epp.debug.state import json_ready
from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.plugin import CycleState, Plugin, clamp_score
from epp.framework.scheduler import ProfileTrace, SchedulerProfile, ScheduleTrace
from epp.framework.types import Endpoint
from epp.logutil import log_failure
from epp.requestcontrol.director import STAGE_DATA_PRODUCERS, STAGES, Stage, StageObserver, StageRun

if TYPE_CHECKING:
    from epp.request.parsing import RequestParser
    from epp.requestcontrol.director import Director

log = logging.getLogger(__name__)

EXPLAIN_REQUEST_ID = "epp-explain"


@dataclass(frozen=True)
class ExplainInput:
    """The request to explain: its path, headers (lower-case names), body and subset hint."""

    path: str
    headers: Mapping[str, str]
    body: bytes
    subset_hint: tuple[str, ...] | None = None


def parse_explain_input(document: Any) -> ExplainInput:
    """The `/debug/explain` request document; ValueError names what is wrong with it.

    `{"body": <the request body: a JSON object, or its text>, "path": "/v1/completions",
    "headers": {"name": "value"}, "subset": ["ip:port", ...]}`; only `body` is required.
    """
    if not isinstance(document, dict):
        raise ValueError("the explain request must be a JSON object with a 'body'")
    unknown = sorted(set(document) - {"body", "path", "headers", "subset"})
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; allowed: body, path, headers, subset")
    body = document.get("body")
    if isinstance(body, dict):
        raw = json.dumps(body).encode()
    elif isinstance(body, str):
        raw = body.encode()
    else:
        raise ValueError("'body' must be the request body: a JSON object or its text")
    path = document.get("path", "/v1/completions")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"'path' must be a request path starting with '/', got {path!r}")
    headers = document.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise ValueError("'headers' must be an object of header names to string values")
    subset = document.get("subset")
    hint: tuple[str, ...] | None = None
    if isinstance(subset, str):
        hint = tuple(part.strip() for part in subset.split(",") if part.strip())
    elif isinstance(subset, list) and all(isinstance(s, str) for s in subset):
        hint = tuple(subset)
    elif subset is not None:
        raise ValueError("'subset' must be a list of ip:port (or one comma-separated string)")
    return ExplainInput(path, {k.lower(): v for k, v in headers.items()}, raw, hint)


def _named(plugin: Plugin) -> dict[str, str]:
    return {"name": plugin.name, "type": plugin.type_name}


class _Recorder(StageObserver):
    """What explain shows of the stages: each stage run or skipped, the producers' and admitters' outcomes."""

    def __init__(self, director: Director) -> None:
        self.director = director
        self.stages: list[dict[str, Any]] = []
        self.producers: list[dict[str, Any]] = []
        self.admitters: list[dict[str, Any]] = []

    def stage(self, stage: Stage, *, skipped: bool) -> None:
        entry: dict[str, Any] = {"stage": stage.name,
                                 "plugins": [p.name for p in self.director.stage_plugins(stage)]}
        if skipped:
            entry["skipped"] = f"side effects: {stage.side_effects}"
        self.stages.append(entry)

    def plugin(self, stage: Stage, plugin: Plugin, outcome: str, seconds: float | None) -> None:
        item: dict[str, Any] = {**_named(plugin), "outcome": outcome}
        if seconds is not None:
            item["ms"] = round(seconds * 1e3, 3)
        (self.producers if stage is STAGE_DATA_PRODUCERS else self.admitters).append(item)

    def goes_on_after(self, refusal: InferenceError) -> bool:
        """Every admitter runs and the scheduler too: the answer shows where the request would have gone."""
        return True


def _profile(name: str, profile: SchedulerProfile, record: ProfileTrace | None, candidates: Sequence[Endpoint],
             primary: str | None) -> dict[str, Any]:
    """One profile's part: its plugins, and per candidate its scores or the filter that dropped it."""
    out: dict[str, Any] = {
        "name": name, "ran": record is not None, "primary": name == primary,
        "filters": [_named(f) for f in profile.filters],
        "scorers": [{**_named(ws.scorer), "weight": ws.weight} for ws in profile.scorers],
        "picker": _named(profile.picker),
    }
    if record is None:
        return out
    totals = {s.endpoint.name: s.score for s in record.totals}
    picked = [ep.name for ep in record.picked]
    rows = []
    for ep in candidates:
        row: dict[str, Any] = {"endpoint": ep.name, "dropped_by": record.dropped.get(ep.name)}
        if ep.name in totals:
            row["scores"] = {ws.scorer.name: round(clamp_score(scores.get(ep.name, 0.0)), 6)
                             for ws, scores in record.scores}
            row["total"] = round(totals[ep.name], 6)  # json_ready makes a non-finite total null
        row["picked"] = ep.name in picked
        rows.append(row)
    rows.sort(key=lambda r: (r["dropped_by"] is not None, -(r.get("total") or 0.0)))
    out["endpoints"] = rows
    out["picked"] = picked
    best = max(totals.values(), default=None)
    out["tied_at_top"] = sum(1 for t in totals.values() if t == best) if best is not None else 0
    return out


async def explain(director: Director, parser: RequestParser, given: ExplainInput) -> dict[str, Any]:
    """The explanation of one request (JSON-ready); raises `InferenceError` when the request does not parse."""
    request, _ = parser.parse(request_id=EXPLAIN_REQUEST_ID, headers={**given.headers, ":path": given.path},
                              body=given.body, subset_hint=given.subset_hint)
    pipeline = director.pipeline
    trace = ScheduleTrace(detailed=True)
    recorder = _Recorder(director)
    run = StageRun(CycleState(), request, size_bytes=len(given.body), side_effects=False, observer=recorder,
                   schedule_trace=trace)
    answer: dict[str, Any] = {
        "request": {},
        "candidates": [], "stages": recorder.stages, "producers": recorder.producers,
        "admitters": recorder.admitters, "profiles": [], "primary_profile": None, "picked": [], "error": None,
        "notes": [],
    }
    try:
        await director.run_stages(run)
    except InferenceError as exc:
        answer["error"] = exc.body
    except Exception as exc:  # a plugin that raises fails the real request too
        log_failure(log, logging.ERROR, "explain: scheduling failed", exc)
        answer["error"] = InferenceError(ErrorCode.INTERNAL, f"scheduling failed: {type(exc).__name__}").body
    # As the stages saw it: the preprocessors give it its session's fairness id.
    request = run.request
    answer["request"] = {"model": request.model, "target_model": request.target_model, "api": request.api,
                         "path": request.path, "objective": request.objective, "priority": request.priority,
                         "fairness_id": request.fairness_id, "stream": request.stream,
                         "slo_ttft_ms": request.slo_ttft_ms, "slo_tpot_ms": request.slo_tpot_ms}
    # The director's stages that did not run because an earlier one ended the request.
    reached = {entry["stage"] for entry in recorder.stages}
    recorder.stages.extend({"stage": stage.name, "plugins": [p.name for p in director.stage_plugins(stage)],
                            "skipped": "not reached"} for stage in STAGES if stage.name not in reached)
    for stage in STAGES:
        if stage.side_effects is not None and director.stage_configured(stage):
            answer["notes"].append(f"{stage.name}: not run ({stage.side_effects})")
    # A refusal is the answer; the scores still show what the pick would have been.
    if run.refusal is not None:
        answer["error"] = run.refusal.body
    answer["candidates"] = [ep.name for ep in run.candidates]
    result = run.result
    primary = result.primary_profile if result is not None else None
    answer["profiles"] = [_profile(name, profile, trace.profiles.get(name), run.candidates, primary)
                          for name, profile in pipeline.scheduler.profiles.items()]
    answer["primary_profile"] = primary
    answer["picked"] = [ep.name for ep in result.targets] if result is not None else []
    return json_ready(answer)
