"""`epp explain`: ask a running picker how it would route one request, and print each scorer's scores.

The picker must run with `--enable-debug-endpoint`; this posts the request to its metrics port
(`POST /debug/explain`, see `epp.debug.explain`) and prints, per profile, a table of each
candidate endpoint's score from each scorer, their weighted sum, the filter that dropped it,
and the endpoint the picker would choose. Nothing is routed or booked.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from epp.framework.headers import MODEL_REWRITE_HEADERS, OBJECTIVE_HEADERS


class ExplainUsageError(Exception):
    """A command-line value `epp explain` cannot use; the message is the one line the user sees."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `epp explain` subcommand."""
    p = sub.add_parser("explain", help="show how a running picker would route a request, scorer by scorer",
                       description="Replay one request against a running picker's current view (epp serve "
                                   "--enable-debug-endpoint) without routing or booking it, and print per endpoint "
                                   "each scorer's score, the weighted total, the filter that dropped it, and the "
                                   "endpoint the picker would choose.")
    p.add_argument("body", help="the request body: a JSON file, '-' for stdin, or the JSON itself ('{...}')")
    p.add_argument("--url", default="http://127.0.0.1:9090",
                   help="the picker's metrics port (default http://127.0.0.1:9090)")
    p.add_argument("--path", default=None,
                   help="the request path (default /v1/chat/completions for a body with messages, "
                        "else /v1/completions)")
    p.add_argument("-H", "--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="a request header (repeatable)")
    p.add_argument("--model-rewrite", help=f"the target model ({MODEL_REWRITE_HEADERS[0]})")
    p.add_argument("--objective", help=f"the InferenceObjective ({OBJECTIVE_HEADERS[0]})")
    p.add_argument("--subset", help="the subset hint: ip:port,... the data plane would allow")
    p.add_argument("--json", action="store_true", help="print the picker's answer as JSON instead of tables")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the picker (default 15)")


def _body_text(arg: str) -> str:
    if arg.lstrip().startswith("{"):
        return arg
    try:
        if arg == "-":
            return sys.stdin.read()
        with open(arg, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise ExplainUsageError(f"cannot read the body {arg}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ExplainUsageError(f"the body {arg} is not UTF-8 text") from None


def explain_document(args: argparse.Namespace) -> dict[str, Any]:
    """The `/debug/explain` request built from the command line."""
    text = _body_text(args.body)
    headers: dict[str, str] = {}
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise ExplainUsageError(f"--header {item!r}: expected 'NAME: VALUE'")
        headers[name.strip().lower()] = value.strip()
    if args.model_rewrite:
        headers[MODEL_REWRITE_HEADERS[0]] = args.model_rewrite
    if args.objective:
        headers[OBJECTIVE_HEADERS[0]] = args.objective
    path = args.path
    if path is None:
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None  # the picker says what is wrong with the body
        chat = isinstance(parsed, dict) and "messages" in parsed
        path = "/v1/chat/completions" if chat else "/v1/completions"
    document: dict[str, Any] = {"body": text, "path": path, "headers": headers}
    if args.subset:
        document["subset"] = args.subset
    return document


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _score(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_profile(profile: dict[str, Any]) -> list[str]:
    """One profile's lines: a header line, then endpoint by scorer (score before weight), total, dropped by."""
    role = " (primary)" if profile.get("primary") else ""
    if not profile.get("ran"):
        return [f"profile {profile['name']}{role}: not run (the profile handler did not choose it)"]
    picked = ", ".join(profile.get("picked") or []) or "none"
    lines = [f"profile {profile['name']}{role}: picker {profile['picker']['name']} picks {picked}"]
    scorers = profile["scorers"]
    rows = [["endpoint", *(s["name"] for s in scorers), "total", "dropped by"],
            ["weight", *(f"{s['weight']:g}" for s in scorers), "", ""]]
    for ep in profile.get("endpoints", []):
        scores = ep.get("scores") or {}
        mark = " *" if ep.get("picked") else ""
        rows.append([ep["endpoint"] + mark, *(_score(scores.get(s["name"])) if scores else "-" for s in scorers),
                     _score(ep.get("total")), ep.get("dropped_by") or ""])
    lines += ["  " + line for line in _table(rows)]
    if profile.get("tied_at_top", 0) > 1:
        lines.append(f"  {profile['tied_at_top']} endpoints tie at the top score: the picker breaks the tie, so the "
                     "real pick may be another of them")
    return lines


def format_answer(answer: dict[str, Any]) -> str:
    """The whole explanation as text."""
    req = answer["request"]
    model = req["model"] if req["model"] == req["target_model"] else f"{req['model']} -> {req['target_model']}"
    lines = [f"request: {req['path']} model {model}, priority {req['priority']}, fairness id {req['fairness_id']}",
             f"candidates: {', '.join(answer['candidates']) or 'none'}"]
    # In the director's order: admitters that read no data, producers, admitters that read data.
    before = {name for stage in answer.get("stages", ()) if stage["stage"] == "admitters-before-data"
              for name in stage["plugins"]}
    items = [("admitter", a) for a in answer["admitters"] if a["name"] in before]
    items += [("producer", p) for p in answer["producers"]]
    items += [("admitter", a) for a in answer["admitters"] if a["name"] not in before]
    for kind, item in items:
        took = f" ({item['ms']:.2f} ms)" if "ms" in item else ""
        lines.append(f"{kind} {item['name']}: {item['outcome']}{took}")
    for profile in answer["profiles"]:
        lines.append("")
        lines += format_profile(profile)
    lines.append("")
    lines += [f"note: {note}" for note in answer["notes"]]
    if answer["error"]:
        if answer["picked"]:  # refused by an admitter: the scores show where it would have gone
            lines.append(f"admitted, it would go to: {', '.join(answer['picked'])}")
        lines.append(f"the picker would answer: {answer['error']}")
    else:
        lines.append(f"the picker would route to: {', '.join(answer['picked'])}")
    return "\n".join(lines) + "\n"


def explain_main(args: argparse.Namespace) -> int:
    """Run `epp explain`: 0 when the picker would route the request, 1 when it would not or cannot say, 2: usage."""
    try:
        document = explain_document(args)
    except ExplainUsageError as exc:
        print(f"epp explain: {exc}", file=sys.stderr)
        return 2
    base = args.url if "://" in args.url else f"http://{args.url}"
    url = base.rstrip("/").removesuffix("/metrics") + "/debug/explain"
    data = json.dumps(document).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as resp:  # noqa: S310 (the user's own picker)
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error") or exc.reason
        except (ValueError, AttributeError):
            message = exc.reason
        print(f"epp explain: {url}: {exc.code} {message}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"epp explain: cannot reach {url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 1
    sys.stdout.write(json.dumps(answer, indent=1) + "\n" if args.json else format_answer(answer))
    return 0 if answer.get("picked") and not answer.get("error") else 1
