"""`POST /debug/explain`: how the running picker would route one request, without routing it.

The request is parsed by the picker's own parser, and its candidates, data producers,
admitters, filters, scorers and pickers run against the picker's current view, as the director
runs them for a real request. Nothing is booked: no flow-control queueing, no capacity gate (a
gate may wake a sleeping replica), no pre-request hook (the prefix index insert, the session
binding, the speculative KV claim), no in-flight booking, no plugin latency metrics. What a data
producer keeps as a cache (tokenizations) or learns from any prompt it hashes may still change.

Pickers that choose at random (ties, `random-picker`, `weighted-random-picker`) may choose
differently for the real request; the answer says how many endpoints tie at the top.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epp.debug.state import json_ready
from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.plugin import CycleState, DataProducer, Plugin, clamp_score
from epp.framework.scheduler import ProfileTrace, SchedulerProfile, ScheduleTrace
from epp.framework.types import Endpoint, InferenceRequest
from epp.logutil import log_failure
from epp.requestcontrol.director import PREPARE_DATA_TIMEOUT_S

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


async def _run_producers(producers: Sequence[DataProducer], state: CycleState, request: InferenceRequest,
                         candidates: Sequence[Endpoint]) -> list[dict[str, Any]]:
    """Run the data producers under the director's deadline; what each did and how long it took."""
    deadline = time.monotonic() + PREPARE_DATA_TIMEOUT_S
    outcomes = []
    for producer in producers:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            outcomes.append({**_named(producer), "outcome": "skipped: the producers' deadline had passed"})
            continue
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(remaining):
                await producer.prepare(state, request, candidates)
            outcome = "ok"
        except TimeoutError:
            outcome = f"timed out (the producers share {PREPARE_DATA_TIMEOUT_S * 1000:.0f} ms)"
        except Exception as exc:  # the director goes on without its data too; never the message (it may quote the prompt)
            outcome = f"failed: {type(exc).__name__}"
        outcomes.append({**_named(producer), "outcome": outcome, "ms": round((time.perf_counter() - t0) * 1e3, 3)})
    return outcomes


def _admission(director: Director, state: CycleState, request: InferenceRequest,
               candidates: Sequence[Endpoint]) -> tuple[list[dict[str, Any]], str | None]:
    """Each admitter's verdict (all of them run), and the answer of the first refusal, if any."""
    outcomes, refusal = [], None
    for admitter in director.pipeline.admitters:
        try:
            admitter.admit(state, request, candidates)
            outcome = "admitted"
        except InferenceError as exc:
            outcome, answer = f"refused: {exc.body}", exc.body
        except Exception as exc:  # the director denies the request, as GIE does
            outcome = f"failed: {type(exc).__name__}"
            answer = InferenceError(ErrorCode.INTERNAL, "request cannot be admitted").body
        outcomes.append({**_named(admitter), "outcome": outcome})
        if outcome != "admitted" and refusal is None:
            refusal = answer
    return outcomes, refusal


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
    state = CycleState()
    request = director.preprocess(state, request)  # its session and fairness id, as a real request gets them
    candidates = director.candidates(request)
    answer: dict[str, Any] = {
        "request": {"model": request.model, "target_model": request.target_model, "api": request.api.value,
                    "path": request.path, "objective": request.objective, "priority": request.priority,
                    "fairness_id": request.fairness_id, "stream": request.stream,
                    "slo_ttft_ms": request.slo_ttft_ms, "slo_tpot_ms": request.slo_tpot_ms},
        "candidates": [ep.name for ep in candidates],
        "producers": [], "admitters": [], "profiles": [], "primary_profile": None, "picked": [], "error": None,
        "notes": [],
    }
    if pipeline.flow_controller is not None:
        answer["notes"].append("flow control: not applied (a real request may wait in its queue first)")
    if pipeline.capacity_gates:
        answer["notes"].append("capacity gates: not run (they may wake sleeping replicas; those are no candidates here)")
    trace = ScheduleTrace(detailed=True)
    result = None
    refusal = None
    if candidates:
        answer["producers"] = await _run_producers(pipeline.data_producers, state, request, candidates)
        answer["admitters"], refusal = _admission(director, state, request, candidates)
    try:
        result = pipeline.scheduler.schedule(state, request, candidates, trace=trace)
    except InferenceError as exc:
        answer["error"] = exc.body
    except Exception as exc:  # a plugin that raises fails the real request too
        log_failure(log, logging.ERROR, "explain: scheduling failed", exc)
        answer["error"] = InferenceError(ErrorCode.INTERNAL, f"scheduling failed: {type(exc).__name__}").body
    # A refusal is the answer; the scores still show what the pick would have been.
    answer["error"] = refusal or answer["error"]
    primary = result.primary_profile if result is not None else None
    answer["profiles"] = [_profile(name, profile, trace.profiles.get(name), candidates, primary)
                          for name, profile in pipeline.scheduler.profiles.items()]
    answer["primary_profile"] = primary
    answer["picked"] = [ep.name for ep in result.targets] if result is not None else []
    return json_ready(answer)
