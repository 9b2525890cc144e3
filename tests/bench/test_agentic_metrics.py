"""What a session replay measures: program completion, the ideal a slowdown is measured against, Jain's
index, samples in plan order; the contenders' table and the combined report's claims; the CPU benchmark's
parts (conversations, the fit)."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from bench import agentic_cpu
from bench.agentic.contenders import (
    AGENTIC_CONTENDERS,
    ALIASES,
    default_contenders,
    is_ours,
    is_peer,
    recommended,
    refusal,
    resolve,
    with_cpu_tier,
)
from bench.agentic.metrics import (
    TurnCost,
    ideal_seconds,
    jain,
    new_tokens,
    program_completion,
    samples,
    session_metrics,
)
from bench.agentic.replay import PauseScale, ReplayResult, SessionResult, TurnResult
from bench.agentic.report import (
    comparison,
    floor,
    load_runs,
    median_row,
    reachable_ratio,
    write_combined,
)
from bench.agentic.runner import scenario
from bench.agentic.workload import AGENT_KINDS, Segment, SessionPlan, TurnPlan
from bench.routing.combine import join_runs
from bench.routing.contenders import Tuning, epp_config
from bench.routing.loadgen import RequestRecord
from bench.routing.measure import percentile
from epp.engine.sim.fleet import default_tokenizer_dir

KIND = AGENT_KINDS[0]
PREFIX = Segment("prefix:claude-code", 1000, "prefix")


def turn(*segments: Segment, out: int = 10, pause: float = 0.0, kind: str = "tool", spawns=(), join=True) -> TurnPlan:
    return TurnPlan(tuple(segments), out, pause, kind, tuple(spawns), join)


def test_new_tokens_are_what_a_turn_adds_and_a_first_turn_pays_all_but_the_shared_prefix():
    a = turn(PREFIX, Segment("s:task", 50, "task"))
    b = turn(PREFIX, Segment("s:task", 50, "task"), Segment("s:0:reply", 10, "reply"), Segment("s:0:tool", 200, "tool"))
    assert new_tokens(None, a) == 50
    assert new_tokens(a, b) == 210
    compacted = turn(PREFIX, Segment("s:0:summary", 30, "summary"))
    assert new_tokens(b, compacted) == 30  # only the prefix is shared with the turn before


def test_a_program_ideal_is_its_turns_alone_plus_pauses_with_joined_sub_agents_on_the_critical_path():
    cost = TurnCost(prefill_s_per_token=0.001, prefill_step_s=0.01, decode_step_s=0.02, chunk_tokens=100)
    assert cost.turn_s(250, 5) == pytest.approx(3 * 0.01 + 0.25 + 4 * 0.02)
    pauses = PauseScale(tool=2.0, human=1.0)
    child = SessionPlan(1, "root.sub0.0", KIND, None, 0, (turn(PREFIX, Segment("c", 100, "task"), out=1),),
                        start_delay_s=0.5)
    root = SessionPlan(0, "root", KIND, 0.0, None, (
        turn(PREFIX, Segment("t", 100, "task"), out=1, pause=1.0, kind="subagents", spawns=(1,)),
        turn(PREFIX, Segment("t", 100, "task"), Segment("r", 100, "report"), out=1)))
    first = cost.turn_s(100, 1)
    child_s = cost.turn_s(100, 1)
    expected = first + max(2.0 * 0.5 + child_s, 0) + 2.0 * 1.0 + cost.turn_s(100, 1)
    assert ideal_seconds([root, child], pauses, cost) == {0: pytest.approx(expected)}
    # Not joined (a trace branch): the program ends with whichever ends last.
    branch = replace(child, turns=(turn(PREFIX, Segment("c", 100, "task"), out=1, pause=100, kind="tool"),
                                   turn(PREFIX, Segment("c", 100, "task"), Segment("x", 10, "tool"), out=1)))
    loose = replace(root, turns=(replace(root.turns[0], join=False), root.turns[1]))
    got = ideal_seconds([loose, branch], pauses, cost)[0]
    assert got == pytest.approx(first + 1.0 + cost.turn_s(100, 1) + 200 + cost.turn_s(10, 1))


def test_jain_is_one_for_equal_slowdowns_and_one_over_n_when_one_program_takes_it_all():
    assert jain([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain([1e-9, 1e-9, 5.0]) == pytest.approx(1 / 3, rel=1e-6)
    assert jain([]) is None


def record(sent: float, e2e: float | None, ttft: float = 0.1, replica: str = "r0", error: str | None = None):
    r = RequestRecord(stage=0, group="g", sent=sent, ttft=ttft if error is None else None, e2e=e2e, replica=replica,
                      error=error, prompt_tokens=100, cached_tokens=50)
    return r


def replay_of(specs) -> ReplayResult:
    """Sessions from (index, parent, [(ready, sent, e2e, replica, error)])."""
    sessions = []
    for index, parent, turns in specs:
        s = SessionResult(index, f"s{index}", "claude-code", parent, len(turns))
        for k, (ready, sent, e2e, replica, error) in enumerate(turns):
            s.turns.append(TurnResult(index, k, record(sent, e2e, replica=replica, error=error), ready, False, 100, 5))
        if s.complete:
            s.finished = s.turns[-1].record.sent + s.turns[-1].record.e2e
        sessions.append(s)
    return ReplayResult(sessions, 0.0, 30.0)


def test_a_program_completes_at_its_last_session_answer_and_is_incomplete_when_any_turn_failed():
    result = replay_of([
        (0, None, [(1.0, 1.0, 2.0, "a", None), (5.0, 5.0, 1.0, "a", None)]),
        (1, 0, [(3.5, 3.5, 6.0, "b", None)]),  # a sub-agent ending after its parent's last turn
        (2, None, [(2.0, 2.0, 1.0, "a", None), (4.0, 4.0, None, "b", "HTTP 503")]),
    ])
    assert program_completion(result) == {0: pytest.approx(8.5), 2: None}
    plans = [SessionPlan(i, f"s{i}", KIND, 0.0 if p is None else None, p, (turn(PREFIX, out=5),)) for i, p in
             ((0, None), (1, 0), (2, None))]
    m = session_metrics(result, plans, {0: 4.25, 2: 1.0})
    assert (m.programs, m.complete, m.sessions, m.sessions_complete) == (2, 1, 3, 2)
    assert m.completion_p90 == pytest.approx(8.5) and m.slowdown_p50 == pytest.approx(2.0)
    assert (m.later_turns, m.turns_moved) == (1, 0)  # the failed turn has no replica to compare
    s = samples(result)
    assert s["completion"] == [8.5, None]
    assert s["ttft"] == [0.1, 0.1, 0.1, 0.1, None] and s["cached"][-1] is None


def tuning() -> Tuning:
    return Tuning(default_tokenizer_dir(), 16, 1e-4, 1000)


def test_the_agentic_comparison_names_ours_llm_d_and_the_peers_session_policies(tmp_path):
    names = default_contenders()
    assert names[0] == "round-robin" and "epp-agentic" in names and "llmd-agentic" in names
    assert "llmd-optimized-baseline" in names
    assert set(recommended()) <= set(names) and "epp-random" not in recommended()
    for peer in ("sglang-router-cache-aware", "vllm-router-cache-aware", "vllm-router-kv-aware",
                 "vllm-router-consistent-hash", "sglang-router-manual"):
        assert peer in names and is_peer(peer)
    assert is_ours("epp-agentic") and not is_ours("epp-random") and not is_peer("llmd-agentic")
    assert resolve("no-such-router") is None and resolve("epp-precise") is not None
    # Every peer that reads only its own session header gets it from the replay.
    for name, headers in ALIASES.items():
        assert name in AGENTIC_CONTENDERS and headers
    sticky = AGENTIC_CONTENDERS["vllm-router-kv-aware-session"]
    assert "--kv-aware-session-affinity-ttl-secs" in sticky.peer_args and sticky.fleet_options["kv_topic"] == ""


def test_epp_agentic_is_told_the_cpu_tier_and_a_refused_config_gives_the_loader_reason(tmp_path):
    c = with_cpu_tier(AGENTIC_CONTENDERS["epp-agentic"], 35_200, tuning(), tmp_path)
    assert c.variant.startswith("file:")
    doc = yaml.safe_load(Path(c.variant.partition(":")[2]).read_text())
    scorer = next(p for p in doc["plugins"] if p["type"] == "session-affinity-cost-scorer")
    assert scorer["parameters"]["cpuTierTokens"] == 35_200
    assert refusal(c, tuning()) is None
    untouched = with_cpu_tier(resolve("epp-precise"), 100, tuning(), tmp_path)
    assert untouched == resolve("epp-precise")
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: no-such-plugin\n")
    why = refusal(replace(c, variant=f"file:{broken}"), tuning())
    assert why is not None and "no-such-plugin" in why
    assert refusal(resolve("round-robin"), tuning()) is None


def profile_scorers(name: str) -> dict[str, int]:
    """The default profile's plugin weights of agentic contender `name`, once our loader took its config."""
    c = resolve(name)
    assert c is not None and refusal(c, tuning()) is None
    doc = yaml.safe_load(epp_config(c.variant, tuning()))
    return {r["pluginRef"]: r.get("weight", 1) for r in doc["schedulingProfiles"][0]["plugins"]}


def test_the_experiments_add_llm_ds_load_scorers_or_drop_the_prefix_scorer():
    base = profile_scorers("epp-agentic")
    assert base == {"session-affinity-cost-scorer": 3, "prefix-cache-scorer": 1, "max-score-picker": 1}
    loaded = profile_scorers("epp-agentic+llmd-load")
    assert loaded == {**base, "queue-scorer": 2, "kv-cache-utilization-scorer": 2, "active-request-scorer": 2,
                      "no-hit-lru-scorer": 1}
    assert list(loaded)[-1] == "max-score-picker"  # the scorers go before the picker
    assert profile_scorers("epp-agentic+no-prefix-scorer") == {"session-affinity-cost-scorer": 3,
                                                               "max-score-picker": 1}


def run_doc(rng: random.Random, ours_scale: float, name_ours: str = "epp-agentic") -> dict:
    """A synthetic agentic run: a peer and ours over the same 60 programs and 300 turns (ours each `ours_scale`
    times the peer's, give or take 10 %)."""
    base_completion = [rng.expovariate(1 / 30) for _ in range(60)]
    base_ttft = [rng.expovariate(1 / 0.5) for _ in range(300)]

    def row(name: str, scale: float) -> dict:
        completion = [round(v * scale * rng.uniform(0.9, 1.1), 4) for v in base_completion]
        ttft = [round(v * scale * rng.uniform(0.9, 1.1), 4) for v in base_ttft]
        return {"name": name, "status": "ok", "verdict": "valid", "overall": {
                    "ttft_p50": 0.3, "ttft_p90": 1.0 * scale, "ttft_p99": 2.0 * scale, "hit_rate": 0.8, "errors": 0,
                    "goodput": {"good_tokens_per_s": 10.0}, "cpu": {"router": 0.1}},
                "sessions": {"completion_p50": 20.0 * scale, "completion_p90": 60.0 * scale,
                             "completion_p99": 90.0 * scale, "slowdown_p50": 1.2, "jain_slowdown": 0.9,
                             "complete": 60, "programs": 60},
                "router_cpu_ms_per_turn": 5.0,
                "samples": {"completion": completion, "ttft": ttft, "prompt": [100] * 300, "cached": [50] * 300}}

    return {"benchmark": "agentic", "scenario": "knee", "scale": "small", "command": "x", "started": "now",
            "plan": "p", "results": [row("vllm-router-kv-aware", 1.0), row(name_ours, ours_scale),
                                     {"name": "llmd-agentic", "status": "unavailable: refused", "overall": None}]}


def test_combined_runs_give_medians_and_claims_with_intervals(tmp_path):
    rng = random.Random(5)
    dirs = []
    for k in range(3):
        d = tmp_path / f"run-{k}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(run_doc(rng, 0.5)))
        dirs.append(d)
    runs = load_runs(dirs)
    assert median_row(runs, "epp-agentic")["completion_p90"] == pytest.approx(30.0)
    assert median_row(runs, "llmd-agentic")["runs"] == 0
    c = comparison(runs, "epp-agentic", "vllm-router-kv-aware", "completion_p90")
    assert c.runs == 3 and c.low > 1.3 and c.verdict(1.3) == "met"  # ours twice as fast on the same programs
    md = write_combined(runs, tmp_path / "combined", "cmd", [d.name for d in dirs]).read_text()
    assert "| epp-agentic | vllm-router-kv-aware (best peer) | program completion p90 | 1.3x |" in md
    assert "**met**" in md and "unavailable: refused" in md
    assert (tmp_path / "combined" / "completion_cdf.png").exists()
    # One run is no claim.
    one = write_combined(runs[:1], tmp_path / "one", "cmd").read_text()
    assert "no claim: 1 run" in one
    with pytest.raises(ValueError, match="not an agentic"):
        (tmp_path / "other.json").write_text(json.dumps({"scenario": "x"}))
        load_runs([tmp_path / "other.json"])


def test_contenders_run_later_join_the_runs_they_pair_with(tmp_path):
    rng = random.Random(9)
    base = [run_doc(rng, 0.5) for _ in range(3)]
    later = [run_doc(rng, 0.8) for _ in range(3)]
    for run in later:  # a later measurement of ours alone, same workload
        run["results"] = [r for r in run["results"] if r["name"] == "epp-agentic"]
        run["started"] = "later"
    joined = join_runs(base, later)
    assert [r["name"] for r in joined[0]["results"]] == ["vllm-router-kv-aware", "llmd-agentic", "epp-agentic"]
    assert median_row(joined, "epp-agentic")["completion_p90"] == pytest.approx(0.8 * 60)  # the later row replaced
    assert joined[1]["joined"] == [{"contenders": ["epp-agentic"], "started": "later", "command": "x"}]
    md = write_combined(joined, tmp_path / "j", "cmd").read_text()
    assert "   - joined (replacing any row of the same name): epp-agentic, started later: `x`" in md
    with pytest.raises(ValueError, match="pair one to one"):
        join_runs(base, later[:2])
    other = [dict(run, scenario="light") for run in later]
    with pytest.raises(ValueError, match="different workloads"):
        join_runs(base, other)


def test_a_target_the_floor_rules_out_is_reported_as_such(tmp_path):
    # The peer's completion p90 is 60 s and no program can finish its work sooner than its ideal: a floor p90 of
    # 55 s means no router shows more than 60 / 55 = 1.09x against the peer, below the 1.3x target.
    rng = random.Random(7)
    runs = []
    for _ in range(3):
        doc = run_doc(rng, 0.95)
        doc["floor"] = {"completion_p50": 18.0, "completion_p90": 55.0, "completion_p99": 80.0}
        runs.append(doc)
    assert reachable_ratio(runs, "vllm-router-kv-aware", "completion_p90", runs[0]["floor"]) == pytest.approx(60 / 55)
    assert reachable_ratio(runs, "vllm-router-kv-aware", "ttft_p90", runs[0]["floor"]) is None
    md = write_combined(runs, tmp_path / "combined", "cmd").read_text()
    assert "| floor (every turn alone, context cached) | - | - | - | 18.0 | 55.0 | 80.0 |" in md
    completion = next(line for line in md.splitlines() if "| program completion p90 | 1.3x |" in line)
    assert "| 1.09x |" in completion and "cannot be met here: it needs a time below the floor" in completion
    ttft = next(line for line in md.splitlines() if "| turn TTFT p90 | 1.3x |" in line)
    assert "below the floor" not in ttft


def test_the_floor_is_the_programs_ideal_completion():
    sc = scenario("knee", "tiny")
    ideal = sorted(ideal_seconds(sc.plans, sc.pauses, sc.cost()).values())
    bound = floor(sc)
    assert bound["completion_p50"] == pytest.approx(percentile(ideal, 50))
    assert ideal[0] <= bound["completion_p50"] <= bound["completion_p90"] <= bound["completion_p99"] <= ideal[-1]


def test_cpu_bench_conversations_stay_around_their_context_and_the_fit_reads_the_slope():
    convs = agentic_cpu.Conversations(5, 20_000, seed=1)
    assert all(16_000 <= c.tokens <= 24_000 for c in convs.items)
    ids = {c.session_id for c in convs.items}
    compacted = 0
    for _ in range(300):
        c = convs.pick()
        assert c is not None and c.session_id in ids
        assert c.segments[0].role == "prefix" and c.segments[0].key == f"prefix:{c.kind.name}"
        before = list(c.segments)
        convs.grow(c)
        if len(c.segments) == len(before) + 2:  # a continuation: the context resent, a reply and a tool result added
            assert c.segments[:len(before)] == before and [s.role for s in c.segments[-2:]] == ["reply", "tool"]
        else:  # past 1.6x the context: the prefix, a summary and the tool result
            compacted += 1
            assert [s.role for s in c.segments] == ["prefix", "summary", "tool"] and c.segments[0] == before[0]
            assert sum(s.tokens for s in before) > 20_000 * 1.6 - 34_000
        assert c.tokens <= 20_000 * 1.6 + 34_000
    assert compacted > 0
    busy = [convs.pick() for _ in range(5)]
    for c in busy:
        c.busy = True
    assert convs.pick() is None
    rows = [{"rate": 0.0, "held": True, "cores": {"picker": 0.2}, "answered": 0, "seconds": 10},
            {"rate": 2.0, "held": True, "cores": {"picker": 0.24}, "answered": 20, "seconds": 10},
            {"rate": 5.0, "held": True, "cores": {"picker": 0.28}, "answered": 40, "seconds": 10},  # 4 answered a second
            {"rate": 8.0, "held": False, "cores": {"picker": 0.9}, "answered": 10, "seconds": 10}]
    f = agentic_cpu.fit(rows)
    assert f["idle_cores"] == pytest.approx(0.2) and f["cpu_s_per_turn"] == pytest.approx(0.02)
    steps = [{"rate": 0.0, "cores": {"picker": 0.2}, "answered": 0, "seconds": 10},
             {"rate": 2.0, "cores": {"picker": 0.3}, "answered": 20, "seconds": 10},
             {"rate": 0.0, "cores": {"picker": 0.22}, "answered": 0, "seconds": 10}]
    agentic_cpu.marginal(steps)
    assert steps[1]["marginal_ms_per_turn"] == pytest.approx((0.3 - 0.21) * 10 / 20 * 1e3)
