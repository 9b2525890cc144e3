"""The agentic benchmark's report: per contender the programs' completion times, the turns' TTFT, hit rate,
fairness, goodput and router CPU; the completion-time CDFs (PNG); over >= 3 runs the claims with their
95 % intervals (bench/routing/confidence.py, paired over the same programs and turns in every run).

One run writes `report.md`, `results.json` (the scenario, its parameters and seeds, every row with
its samples) and `completion_cdf.png` into its folder; `combine` (or `run --repeats N`) writes the
same three for several runs: medians of every number, and the claims.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.agentic.contenders import LLMD, is_ours, is_peer
from bench.agentic.metrics import CLAIM_METRICS, ideal_seconds, run_samples
from bench.agentic.runner import AgenticScenario
from bench.routing.confidence import MIN_RUNS, Comparison, compare
from bench.routing.measure import percentile

# (metric, the target ratio) of each claim against the best peer, llm-d's agentic pipeline and round-robin
# (issue 43): completion p90 >= 1.3x the best peer's and >= 1.15x llm-d's agentic pipeline's; TTFT p90 and
# p99 >= 1.3x the best peer's; every recommended pipeline ahead of the best peer.
CLAIMS = (("completion_p90", "best peer", 1.3), ("ttft_p90", "best peer", 1.3), ("ttft_p99", "best peer", 1.3),
          ("ttft_p90", "best peer", 1.0), ("completion_p90", "llmd-agentic", 1.15),
          ("completion_p90", "llmd-optimized-baseline", 1.0), ("completion_p90", "round-robin", 1.0))


def _s(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def floor(sc: AgenticScenario) -> dict[str, float | None]:
    """The programs' ideal completion times' p50 / p90 / p99 (wall s): no router can finish them sooner."""
    ideal = list(ideal_seconds(sc.plans, sc.pauses, sc.cost()).values())
    return {f"completion_p{q}": percentile(ideal, q) for q in (50, 90, 99)}


def run_document(sc: AgenticScenario, rows: list[dict[str, Any]], command: str, started: str) -> dict[str, Any]:
    """The results.json of one run."""
    return {"floor": floor(sc), "benchmark": "agentic", "scenario": sc.name, "scale": sc.scale, "command": command, "started": started,
            "python": platform.python_version(), "workload": sc.workload, "plan": sc.describe(),
            "fleet": asdict(sc.fleet), "pauses": asdict(sc.pauses),
            "deadline_s": sc.deadline_s, "ttft_objective_ms": sc.ttft_objective_ms, "text_seed": sc.text_seed,
            "notes": sc.notes,
            "results": rows}


def _row(r: dict[str, Any]) -> str:
    if r.get("overall") is None:
        return f"| {r['name']} | {r['status']} |" + " |" * 15
    o, s = r["overall"], r["sessions"]
    g = o.get("goodput") or {}
    good = g.get("good", 0) / g["requests"] if g.get("requests") else None
    cached = [(c, p) for c, p in zip(r["samples"]["cached"], r["samples"]["prompt"]) if c is not None and p]
    usage_hit = sum(c for c, _ in cached) / sum(p for _, p in cached) if cached else None
    moved = s["turns_moved"] / s["later_turns"] if s["later_turns"] else None
    return (f"| {r['name']} | {r.get('verdict') or '-'} | {s['complete']}/{s['programs']} | {_s(s['completion_p50'], 1)} | "
            f"{_s(s['completion_p90'], 1)} | {_s(s['completion_p99'], 1)} | {_s(s['slowdown_p50'])} | "
            f"{_s(s['jain_slowdown'], 3)} | {_s(o['ttft_p50'], 3)} | {_s(o['ttft_p90'], 3)} | {_s(o['ttft_p99'], 3)} | "
            f"{_pct(o['hit_rate'])} / {_pct(usage_hit)} | {_pct(good)} | {g.get('good_tokens_per_s', 0):.1f} | "
            f"{_pct(moved)} | {o['cpu'].get('router', 0):.2f} / {r['router_cpu_ms_per_turn']:.1f} | {o['errors']} |")


HEADER = ["| contender | check | programs done | completion p50 (s) | p90 | p99 | slowdown p50 | Jain (slowdown) | "
          "TTFT p50 (s) | p90 | p99 | hit rate (replicas / usage) | turns within TTFT objective | good tok/s | turns moved | "
          "router CPU cores / ms per turn | errors |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def cdf_plot(series: dict[str, list[float]], path: Path, title: str) -> Path | None:
    """Program completion CDFs, one line per contender (None when matplotlib is missing or nothing completed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not any(series.values()):
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, values in series.items():
        if not values:
            continue
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        style = "-" if is_ours(name) else ("--" if is_peer(name) or name in LLMD else ":")
        ax.step(xs, ys, style, where="post", label=name, linewidth=1.4)
    ax.set_xlabel("program completion time (wall s)")
    ax.set_ylabel("share of programs completed")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _completions(rows: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        if r.get("overall") is None:
            continue
        out.setdefault(r["name"], []).extend(v for v in r["samples"]["completion"] if v is not None)
    return out


def write_run(sc: AgenticScenario, rows: list[dict[str, Any]], out: Path, command: str, started: str) -> Path:
    """report.md, results.json and completion_cdf.png of one run."""
    out.mkdir(parents=True, exist_ok=True)
    doc = run_document(sc, rows, command, started)
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    plot = cdf_plot(_completions(rows), out / "completion_cdf.png", f"agentic {sc.name} ({sc.scale}): programs")
    lines = [f"# Agentic benchmark: {sc.name} ({sc.scale})", "", f"Command: `{command}`  ", f"Started: {started}", "",
             "## Setup", "", f"- Workload: {sc.describe()}", f"- Parameters and seeds: {_params(sc)} (all of them in results.json)",
             f"- Fleet: {_fleet(sc)}", f"- Pauses: {_pauses(sc)}", f"- Deadline: {sc.deadline_s:g} s; TTFT objective "
             f"{sc.ttft_objective_ms:g} ms", *(f"- {n}" for n in sc.notes), "", "## Results", "", *HEADER,
             *(_row(r) for r in rows), _floor_row(doc["floor"]), "",
             *_legend(), ""]
    if plot:
        lines += [f"![program completion CDF]({plot.name})", ""]
    (out / "report.md").write_text("\n".join(lines))
    return out / "report.md"


def _floor_row(f: dict[str, float | None]) -> str:
    """The ideal programs as a row under the contenders' (completion columns only)."""
    return (f"| floor (every turn alone, context cached) | - | - | {_s(f.get('completion_p50'), 1)} | "
            f"{_s(f.get('completion_p90'), 1)} | {_s(f.get('completion_p99'), 1)} | 1.00 |" + " - |" * 10)


def _params(sc: AgenticScenario) -> str:
    g = sc.workload.get("generator")
    if g is None:
        return f"trace knobs {json.dumps(sc.workload.get('trace'))}, text seed {sc.text_seed}"
    return (f"generator seed {g['seed']}, token scale {g['token_scale']:g}, {g['sessions']} sessions at "
            f"{g['session_rate']:g}/s")


def _fleet(sc: AgenticScenario) -> str:
    f = sc.fleet
    return (f"{f.replicas} simulated replicas, profile {f.profile} slowed {f.time_scale:g}x, {f.num_gpu_blocks} GPU "
            f"blocks and {f.cpu_blocks} CPU-tier blocks of {sc.block_size} tokens, max model length {f.max_model_len}")


def _pauses(sc: AgenticScenario) -> str:
    p = sc.pauses
    return (f"wall seconds per agent second: tool {p.tool:g}, human {p.human:g}, trace {p.trace:g} (against the "
            f"fleet's time scale {sc.fleet.time_scale:g}: pauses last {p.tool / sc.fleet.time_scale:g}x (tool) and "
            f"{p.human / sc.fleet.time_scale:g}x (human) of their agent length in simulated-GPU seconds)")


def _legend() -> list[str]:
    return ["Completion: a program's root start to the last answer of any of its sessions (wall s; incomplete "
            "programs left out here, infinitely late in the claims). Slowdown: completion over the program's ideal "
            "(every turn alone, context cached, plus the pauses; the floor row: its p50 / p90 / p99 over the programs, "
            "what no router can beat). Jain: of the slowdowns (1 = all slowed alike). "
            "TTFT over every turn. Hit rate: the replicas' prefix-cache counters / the responses' cached tokens. "
            "Turns moved: later turns served by another replica than their session's previous one. Router CPU: "
            "cores over the replay (Envoy + picker, or the peer) and CPU ms per answered turn."]


# ---- several runs --------------------------------------------------------------------------------

def load_runs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The runs of each results.json (a combination contributes all of its runs)."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        file = path / "results.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"{path}: no results.json")
        doc = json.loads(file.read_text())
        if doc.get("benchmark") != "agentic":
            raise ValueError(f"{file}: not an agentic benchmark result")
        runs.extend(doc["runs"] if "runs" in doc else [doc])
    if not runs:
        raise ValueError("no runs to combine")
    if len({(r["scenario"], r["scale"]) for r in runs}) > 1:
        raise ValueError("runs of different scenarios cannot be combined")
    return runs


def _names(runs: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["name"] for run in runs for r in run["results"]))


def _rows(runs: Sequence[dict[str, Any]], name: str) -> list[dict[str, Any] | None]:
    out = []
    for run in runs:
        r = next((x for x in run["results"] if x["name"] == name), None)
        out.append(r if r is not None and r.get("overall") is not None and r.get("verdict") != "invalid" else None)
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(present) if present else None


def median_row(runs: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """One contender over the runs: the median of each number it reported."""
    rows = [r for r in _rows(runs, name) if r is not None]
    if not rows:
        first = next((x for run in runs for x in run["results"] if x["name"] == name), {"status": "absent"})
        return {"name": name, "runs": 0, "status": first["status"]}

    def med(path: tuple[str, ...]) -> float | None:
        vals = []
        for r in rows:
            v: Any = r
            for k in path:
                v = v.get(k) if isinstance(v, dict) else None
            vals.append(v if isinstance(v, (int, float)) else None)
        return _median(vals)

    keys = {"completion_p50": ("sessions", "completion_p50"), "completion_p90": ("sessions", "completion_p90"),
            "completion_p99": ("sessions", "completion_p99"), "slowdown_p50": ("sessions", "slowdown_p50"),
            "jain": ("sessions", "jain_slowdown"), "complete": ("sessions", "complete"),
            "programs": ("sessions", "programs"), "ttft_p50": ("overall", "ttft_p50"),
            "ttft_p90": ("overall", "ttft_p90"), "ttft_p99": ("overall", "ttft_p99"),
            "hit_rate": ("overall", "hit_rate"), "good_tok_s": ("overall", "goodput", "good_tokens_per_s"),
            "router_cores": ("overall", "cpu", "router"), "router_ms_per_turn": ("router_cpu_ms_per_turn",),
            "errors": ("overall", "errors")}
    verdicts = {r.get("verdict") for r in rows}
    return {"name": name, "runs": len(rows), "status": "ok", "verdict": "/".join(sorted(v for v in verdicts if v)),
            **{k: med(p) for k, p in keys.items()}}


def best(runs: Sequence[dict[str, Any]], key: str, among: Sequence[str]) -> str | None:
    """The contender of `among` with the lowest median `key` (a measured, valid one)."""
    rows = [median_row(runs, n) for n in among]
    rows = [r for r in rows if r.get(key) is not None]
    return min(rows, key=lambda r: r[key])["name"] if rows else None


def comparison(runs: Sequence[dict[str, Any]], a: str, b: str, metric: str) -> Comparison:
    """A against B on a claim metric over the runs where both were measured."""
    pairs = [(x, y) for x, y in zip(_rows(runs, a), _rows(runs, b)) if x is not None and y is not None]
    return compare([run_samples(x["samples"], metric) for x, _ in pairs],
                   [run_samples(y["samples"], metric) for _, y in pairs], CLAIM_METRICS[metric], a=a, b=b)


def claim_lines(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Each of our pipelines against the best peer, llm-d's pipelines and round-robin, per claim of `CLAIMS`."""
    names = _names(runs)
    peers = [n for n in names if is_peer(n)]
    best_peer = {m: best(runs, m, peers) for m in ("completion_p90", "ttft_p90", "ttft_p99")}
    floors = _floor(runs)
    lines = ["| ours | against | statistic | target | ratio (> 1: ours better) [95 % interval], runs | at most "
             "(the other's over the floor) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name in names:
        if not is_ours(name) or median_row(runs, name)["runs"] == 0:
            continue
        for metric, against, target in CLAIMS:
            other = best_peer.get(metric) if against == "best peer" else against
            if other is None or other not in names or median_row(runs, other)["runs"] == 0:
                continue
            c = comparison(runs, name, other, metric)
            if c.runs == 0:
                continue
            verdict = c.verdict(target)
            shown = {"met": "**met**", "not met": "not met", "tie": "tie (the interval includes the target)",
                     "too few runs": f"no claim: {c.runs} run{'s' * (c.runs != 1)} (a claim needs {MIN_RUNS})"}[verdict]
            reachable = reachable_ratio(runs, other, metric, floors)
            if reachable is not None and reachable < target:
                shown += f"; cannot be met here: it needs a time below the floor (no router reaches more than {reachable:.2f}x)"
            label = f"{other} (best peer)" if against == "best peer" else other
            lines.append(f"| {name} | {label} | {CLAIM_METRICS[metric].name} | {target:g}x | {c.describe()} | "
                         f"{'-' if reachable is None else f'{reachable:.2f}x'} | {shown} |")
    return lines


def _floor(runs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The floor of the runs (one workload, so one floor; runs written before it was recorded have none)."""
    recorded = [run["floor"] for run in runs if run.get("floor")]
    return recorded[0] if recorded else {}


def reachable_ratio(runs: Sequence[dict[str, Any]], other: str, metric: str,
                    floors: dict[str, float | None]) -> float | None:
    """The highest ratio any router can show against `other` on `metric`: its median over the floor (None: no floor
    for that statistic)."""
    bound, theirs = floors.get(metric), median_row(runs, other).get(metric)
    return theirs / bound if bound and theirs is not None else None


def knee_line(runs: Sequence[dict[str, Any]], light: Sequence[dict[str, Any]]) -> str:
    """The best peer's TTFT p90 here against the light runs' (the knee: 3-10x)."""
    peers = [n for n in _names(runs) if is_peer(n)]
    name = best(runs, "ttft_p90", peers)
    if name is None:
        return "Knee check: no peer measured here."
    here, there = median_row(runs, name).get("ttft_p90"), median_row(light, name).get("ttft_p90")
    if here is None or not there:
        return f"Knee check: the best peer {name} was not measured in the light runs."
    ratio = here / there
    inside = "within" if 3 <= ratio <= 10 else "outside"
    return (f"Knee check: the best peer here ({name}) has TTFT p90 {here:.3f} s against {there:.3f} s at the light "
            f"load: {ratio:.1f}x, {inside} the knee's 3-10x.")


def write_combined(runs: Sequence[dict[str, Any]], out: Path, command: str, run_dirs: Sequence[str] = (),
                   light: Sequence[dict[str, Any]] = ()) -> Path:
    """The combined report.md, results.json (every run whole, the medians) and completion_cdf.png."""
    out.mkdir(parents=True, exist_ok=True)
    names = _names(runs)
    first = runs[0]
    doc = {"benchmark": "agentic", "scenario": first["scenario"], "scale": first["scale"], "command": command,
           "workload": first.get("workload"), "medians": [median_row(runs, n) for n in names], "runs": list(runs)}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    series: dict[str, list[float]] = {}
    for run in runs:
        for n, v in _completions(run["results"]).items():
            series.setdefault(n, []).extend(v)
    plot = cdf_plot(series, out / "completion_cdf.png",
                    f"agentic {first['scenario']} ({first['scale']}): programs, {len(runs)} runs pooled")
    lines = [f"# Agentic benchmark: {first['scenario']} ({first['scale']}), {len(runs)} runs", "",
             f"Command: `{command}`  ", f"Combined: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", "",
             f"Workload: {first.get('plan', '')}", "", "## Runs", ""]
    for i, run in enumerate(runs):
        where = f" ({run_dirs[i]}/report.md)" if i < len(run_dirs) else ""
        lines.append(f"{i + 1}. started {run.get('started', '?')}: `{run.get('command', '?')}`{where}")
        lines += [f"   - joined (replacing any row of the same name): {', '.join(j['contenders'])}, started "
                  f"{j.get('started') or '?'}: `{j.get('command') or '?'}`" for j in run.get("joined", ())]
    lines += ["", "## Medians over the runs", "",
              "| contender | runs | check | programs done | completion p50 (s) | p90 | p99 | slowdown p50 | Jain | "
              "TTFT p50 (s) | p90 | p99 | hit rate | good tok/s | router cores | router ms/turn | errors |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    floors = _floor(runs)
    for n in names:
        m = median_row(runs, n)
        if not m["runs"]:
            lines.append(f"| {n} | 0 | {m['status']} |" + " |" * 14)
            continue
        lines.append(f"| {n} | {m['runs']} | {m['verdict'] or '-'} | {_s(m['complete'], 0)}/{_s(m['programs'], 0)} | "
                     f"{_s(m['completion_p50'], 1)} | {_s(m['completion_p90'], 1)} | {_s(m['completion_p99'], 1)} | "
                     f"{_s(m['slowdown_p50'])} | {_s(m['jain'], 3)} | {_s(m['ttft_p50'], 3)} | {_s(m['ttft_p90'], 3)} | "
                     f"{_s(m['ttft_p99'], 3)} | {_pct(m['hit_rate'])} | {_s(m['good_tok_s'], 1)} | "
                     f"{_s(m['router_cores'])} | {_s(m['router_ms_per_turn'], 1)} | {_s(m['errors'], 0)} |")
    if floors:
        lines.append(f"| floor (every turn alone, context cached) | - | - | - | {_s(floors.get('completion_p50'), 1)} | "
                     f"{_s(floors.get('completion_p90'), 1)} | {_s(floors.get('completion_p99'), 1)} | 1.00 |"
                     + " - |" * 9)
    lines += ["", "## Claims (issue 43)", "",
              "Each of our pipelines against the best peer (the external router with the lowest median of that "
              "statistic), llm-d's pipelines and round-robin. Ratio: the other's statistic over ours, paired over "
              "the same programs and turns in each run; the interval counts the programs or turns within each run "
              "(bootstrap) and the spread across runs (bench/routing/confidence.py). An incomplete program counts as "
              f"infinitely late. A claim needs {MIN_RUNS} runs; an interval that includes the target is a tie. At "
              "most: the other's median over the floor, the highest ratio a router finishing every program at its "
              "ideal time would show (a target above it cannot be met on this workload).", "",
              *claim_lines(runs), ""]
    if light:
        lines += [knee_line(runs, light), ""]
    if plot:
        lines += [f"![program completion CDF]({plot.name})", ""]
    (out / "report.md").write_text("\n".join(lines))
    return out / "report.md"


__all__ = ["CLAIMS", "best", "cdf_plot", "claim_lines", "comparison", "floor", "knee_line", "load_runs",
           "median_row",
           "reachable_ratio", "run_document", "write_combined", "write_run"]
