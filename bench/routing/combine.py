"""Several runs of one routing scenario as one result: per-run numbers, medians, and claims with intervals.

`python -m bench.routing run ... --repeats N` writes each run into `<out>/run-<k>/` (not kept in
git) and then this module's combined `report.md` and `results.json` into `<out>/`;
`python -m bench.routing combine DIR... --out DIR` does the same with runs made separately (each
DIR a single run or an earlier combination). The combined results.json keeps every run whole
(`runs`, with the per-request samples) and, under `results`, one row per contender with the median
over its runs of every number of its summary, so readers of a single run read a combination alike.
The claims of the report compare each contender with the best peer and with round-robin: the ratio
of their TTFT p90 with its 95 % interval (bench/routing/confidence.py), marked a tie when the
interval includes 1.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.routing.confidence import MIN_RUNS, Comparison, RunSamples, compare

PEER_PREFIXES = ("vllm-router-", "sglang-router-", "llmd-")


def load_runs(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The runs in the results.json of each path (a folder or the file): a combination contributes all of its."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        file = path / "results.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"{path}: no results.json")
        doc = json.loads(file.read_text())
        runs.extend(doc["runs"] if "runs" in doc else [doc])
    if not runs:
        raise ValueError("no runs to combine")
    scenarios = {(r.get("scenario"), r.get("scale")) for r in runs}
    if len(scenarios) > 1:
        raise ValueError(f"runs of different scenarios cannot be combined: {sorted(map(str, scenarios))}")
    return runs


def _median_tree(values: Sequence[Any]) -> Any:
    """The median of numbers, key by key through dicts; other values from the first run."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, bool) or not isinstance(first, (int, float, dict)):
        return first
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in present if isinstance(v, dict) for k in v)
        return {k: _median_tree([v.get(k) for v in present if isinstance(v, dict)]) for k in keys}
    numbers = [float(v) for v in present if isinstance(v, (int, float)) and math.isfinite(float(v))]
    return statistics.median(numbers) if numbers else first


def _result(run: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((r for r in run["results"] if r["name"] == name), None)


def contenders(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Every contender name, in the order the runs first name them."""
    return list(dict.fromkeys(r["name"] for run in runs for r in run["results"]))


def join_runs(base: Sequence[dict[str, Any]], joining: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`base`'s runs with the k-th run of `joining` added to the k-th (a contender of both: `joining`'s row replaces
    `base`'s): contenders measured at other times on the same workload, compared as if in one run."""
    if len(base) != len(joining):
        raise ValueError(f"cannot join {len(joining)} runs to {len(base)}: the runs pair one to one")
    out = []
    for mine, theirs in zip(base, joining):
        if (mine["scenario"], mine["scale"], mine.get("workload")) != (theirs["scenario"], theirs["scale"],
                                                                      theirs.get("workload")):
            raise ValueError("runs of different workloads cannot be joined")
        names = {r["name"] for r in theirs["results"]}
        run = dict(mine)
        run["results"] = [r for r in mine["results"] if r["name"] not in names] + list(theirs["results"])
        run["joined"] = [*mine.get("joined", ()), {"contenders": sorted(names), "started": theirs.get("started"),
                                                     "command": theirs.get("command")}]
        run["floor"] = mine.get("floor") or theirs.get("floor")
        out.append(run)
    return out


def combined_row(runs: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """One contender over the runs: medians of its summaries, the worst validity, how many runs measured it."""
    rows = [r for run in runs if (r := _result(run, name)) is not None]
    measured = [r for r in rows if r.get("overall") is not None and r.get("verdict") != "invalid"]
    verdicts = {r.get("verdict") for r in rows}
    verdict = "invalid" if "invalid" in verdicts else ("valid" if verdicts == {"valid"} else
                                                       next(iter(verdicts - {"valid"}), "") or "")
    return {"name": name, "status": "ok" if measured else (rows[0]["status"] if rows else "absent"),
            "verdict": verdict, "validity": "; ".join(dict.fromkeys(r.get("validity", "") for r in rows if r.get("validity"))),
            "version": rows[0].get("version", "") if rows else "", "flags": rows[0].get("flags", "") if rows else "",
            "runs": len(measured), "overall": _median_tree([r["overall"] for r in measured]) if measured else None}


def samples(runs: Sequence[dict[str, Any]], name: str) -> list[RunSamples | None]:
    """The contender's per-request samples in each run (None where it was not measured or kept none)."""
    out: list[RunSamples | None] = []
    for run in runs:
        r = _result(run, name)
        ok = r is not None and r.get("overall") is not None and r.get("verdict") != "invalid" and r.get("samples")
        out.append(RunSamples.from_json(r["samples"]) if ok else None)  # type: ignore[index]
    return out


def comparison(runs: Sequence[dict[str, Any]], a: str, b: str, metric: str = "ttft_p90") -> Comparison:
    """A against B over the runs where both were measured with samples."""
    pairs = [(x, y) for x, y in zip(samples(runs, a), samples(runs, b)) if x is not None and y is not None]
    return compare([x for x, _ in pairs], [y for _, y in pairs], metric, a=a, b=b)


def is_peer(name: str) -> bool:
    """A router we compare against (not ours, not round-robin)."""
    return name.startswith(PEER_PREFIXES) and not name.endswith("-rr")


def best_peer(runs: Sequence[dict[str, Any]], metric_key: str = "ttft_p90") -> str | None:
    """The valid peer with the lowest median TTFT p90 over the runs."""
    rows = [combined_row(runs, n) for n in contenders(runs) if is_peer(n)]
    rows = [r for r in rows if r["overall"] is not None and r["overall"].get(metric_key) is not None]
    return min(rows, key=lambda r: r["overall"][metric_key])["name"] if rows else None


def combined(runs: Sequence[dict[str, Any]], command: str) -> dict[str, Any]:
    """The combined results.json: every run whole, then one median row per contender."""
    first = runs[0]
    floors = [r["floor"] for r in runs if "floor" in r]
    doc: dict[str, Any] = {
        "scenario": first.get("scenario"), "scale": first.get("scale"), "command": command,
        "started": max(r.get("started", "") for r in runs), "python": first.get("python"),  # the last run's
        "run_commands": list(dict.fromkeys(r.get("command", "") for r in runs)),
        "results": [combined_row(runs, n) for n in contenders(runs)], "runs": list(runs)}
    if floors:
        doc["floor"] = _median_tree(floors)
    return doc


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def claim_lines(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Each contender against the best peer and round-robin: TTFT p90 ratio, 95 % interval, verdict."""
    peer = best_peer(runs)
    lines = ["| contender | against | TTFT p90 ratio (> 1: contender faster) [95 % interval], runs | verdict | "
             "hit-rate ratio [95 %] |", "|---|---|---|---|---|"]
    for name in contenders(runs):
        if is_peer(name):
            continue
        for other in (peer, "round-robin"):
            if other is None or other == name or other not in contenders(runs):
                continue
            c = comparison(runs, name, other)
            if c.runs == 0:
                continue
            verdict = {"met": "faster", "not met": "slower", "tie": "**tie** (interval includes 1)",
                       "too few runs": f"no claim: {c.runs} run{'s' * (c.runs != 1)} (a claim needs {MIN_RUNS})"}
            hit = comparison(runs, name, other, "hit")
            lines.append(f"| {name} | {other} | {c.describe()} | {verdict[c.verdict()]} | "
                         f"{hit.describe() if hit.runs else '-'} |")
    return lines


def write_combined(runs: Sequence[dict[str, Any]], out_dir: Path, command: str,
                   run_dirs: Sequence[str] = ()) -> Path:
    """Write the combined report.md and results.json into `out_dir`; returns the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = combined(runs, command)
    names = contenders(runs)
    lines = [f"# Routing benchmark: {doc['scenario']} ({doc['scale']}), {len(runs)} runs", "",
             f"Command: `{command}`  ", f"Combined: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", "",
             "## Runs", ""]
    for i, run in enumerate(runs):
        where = f" ({run_dirs[i]}/report.md, not kept in git)" if i < len(run_dirs) else ""
        lines.append(f"{i + 1}. started {run.get('started', '?')}: `{run.get('command', '?')}`{where}")
    lines += ["", "## TTFT p90 per run (s) and the median", "",
              "| contender | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median | hit rate (median) "
              "| output tok/s (median) | requests per replica, run 1 | check |",
              "|---|" + "---|" * len(runs) + "---|---|---|---|---|"]
    for name in names:
        row = combined_row(runs, name)
        cells = []
        for run in runs:
            r = _result(run, name)
            cells.append(_s(r["overall"]["ttft_p90"]) if r and r.get("overall") else (r or {}).get("status", "-"))
        o = row["overall"] or {}
        first = next((r for run in runs if (r := _result(run, name)) and r.get("overall")), None)
        spread = "/".join(str(v) for v in (first["overall"].get("per_replica") or {}).values()) if first else "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_s(o.get('ttft_p90'))} | {_pct(o.get('hit_rate'))} | "
                     f"{o.get('output_tokens_per_s', 0):.1f} | {spread or '-'} | {row['verdict'] or '-'} |")
    lines += ["", "## Claims: each contender against the best peer and round-robin", "",
              f"Best peer (lowest median TTFT p90): {best_peer(runs) or 'none measured'}. Ratio: the other's TTFT p90 "
              "over the contender's, so > 1 means the contender is faster; the interval counts the requests "
              "within each run (bootstrap) and the spread across runs (bench/routing/confidence.py). A claim "
              f"needs {MIN_RUNS} runs; an interval that includes 1 is a tie.", "", *claim_lines(runs), ""]
    (out_dir / "report.md").write_text("\n".join(lines))
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    return out_dir / "report.md"


__all__ = ["best_peer", "claim_lines", "combined", "combined_row", "comparison", "contenders", "is_peer",
           "join_runs", "load_runs", "samples", "write_combined"]
