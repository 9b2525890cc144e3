"""bench/README.md's standing tables are what the result files say, and the renderer refuses what it cannot back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.standing import BENCH, END, ROWS, START, Row, StandingError, check, render, replace_standing


def routing_run(root: Path, folder: str, p90s: dict[str, float], command: str = "python -m bench.routing run x") -> None:
    """A routing results.json with one contender per entry (hit rate 0.5, started on 2026-12-04)."""
    (root / folder).mkdir(parents=True)
    results = [{"name": name, "verdict": "valid",
                "overall": {"ttft_p90": p90, "hit_rate": 0.5, "oracle_hit_rate": 0.9}} for name, p90 in p90s.items()]
    (root / folder / "results.json").write_text(json.dumps(
        {"command": f"{command} --out bench/results/{folder} --quiet", "started": "2026-12-04 10:00:00 UTC",
         "results": results}))


def faster_than_peer(folder: str = "run-a") -> Row:
    return Row("Routing", "ours ≥ 2x the best peer (#0)",
               "ours {sec(p90(F, 'ours'))} against {best_peer(F)} {sec(p90(F, best_peer(F)))}", (folder,),
               met="p90(F, best_peer(F)) / p90(F, 'ours') >= 2")


def readme_with(tables: str) -> str:
    return replace_standing(f"# Benchmarks\n\n{START}\n{END}\n\nafter\n", tables)


def test_the_readme_shows_what_the_results_say():
    assert check(BENCH / "README.md", ROWS, BENCH / "results", BENCH / "notes") == []


def test_a_row_shows_the_numbers_command_and_date_of_its_result(tmp_path):
    routing_run(tmp_path, "run-a", {"ours": 0.3, "sglang-router-cache-aware": 0.9, "vllm-router-rr": 0.1})

    table = render([faster_than_peer()], tmp_path, tmp_path)

    assert ("| ours ≥ 2x the best peer (#0) | ours 0.300 s against sglang-router-cache-aware 0.900 s | met "
            "| `python -m bench.routing run x` | [run-a](results/run-a/) | 2026-12-04 |") in table


def test_a_result_that_changes_is_a_difference_the_check_reports(tmp_path):
    routing_run(tmp_path, "run-a", {"ours": 0.3, "sglang-router-cache-aware": 0.9})
    readme = tmp_path / "README.md"
    readme.write_text(readme_with(render([faster_than_peer()], tmp_path, tmp_path)))
    assert check(readme, [faster_than_peer()], tmp_path, tmp_path) == []

    data = json.loads((tmp_path / "run-a" / "results.json").read_text())
    data["results"][0]["overall"]["ttft_p90"] = 0.6
    (tmp_path / "run-a" / "results.json").write_text(json.dumps(data))

    diff = check(readme, [faster_than_peer()], tmp_path, tmp_path)
    assert any(line.startswith("+") and "ours 0.600 s" in line and "**not met**" in line for line in diff)
    assert any(line.startswith("-") and "ours 0.300 s" in line for line in diff)


def test_text_outside_the_markers_is_left_alone(tmp_path):
    routing_run(tmp_path, "run-a", {"ours": 0.3, "sglang-router-cache-aware": 0.9})
    readme = readme_with(render([faster_than_peer()], tmp_path, tmp_path))

    assert readme.startswith("# Benchmarks\n\n" + START) and readme.endswith(END + "\n\nafter\n")
    with pytest.raises(StandingError, match="one standing start marker"):
        replace_standing("no markers here", "table")


def test_a_note_row_must_find_every_number_it_shows_in_its_note(tmp_path):
    (tmp_path / "n.md").write_text("# A note\n\n## Speed\n\n914–974 k blocks/s on a quiet machine, lookup p50 19.3 µs.\n")
    row = Row("Index", "fast (#0)", "914–974 k blocks/s, lookup p50 9.3 µs", verdict="met", command="python x.py",
              date="2026-12-02", notes=("n.md#speed",))

    with pytest.raises(StandingError, match="9.3 not in n.md#speed"):
        render([row], tmp_path, tmp_path)
    assert "no result file; see [n.md](notes/n.md#speed)" in render(
        [Row("Index", "fast (#0)", "914–974 k blocks/s", verdict="met", command="python x.py", date="2026-12-02",
             notes=("n.md#speed",))], tmp_path, tmp_path)


def test_a_note_row_names_a_heading_that_exists(tmp_path):
    (tmp_path / "n.md").write_text("# A note\n\n914 blocks\n")
    row = Row("Index", "fast (#0)", "914 blocks", verdict="met", command="python x.py", date="2026-12-02",
              notes=("n.md#gone",))

    with pytest.raises(StandingError, match="no heading #gone in bench/notes/n.md"):
        render([row], tmp_path, tmp_path)


def test_a_row_reads_only_the_results_it_names(tmp_path):
    routing_run(tmp_path, "run-a", {"ours": 0.3, "sglang-router-cache-aware": 0.9})
    routing_run(tmp_path, "run-b", {"ours": 0.2, "sglang-router-cache-aware": 0.9})
    row = Row("Routing", "ours (#0)", "{sec(p90('run-b', 'ours'))}", ("run-a",), verdict="measured")

    with pytest.raises(StandingError, match="reads run-b/results.json outside its results"):
        render([row], tmp_path, tmp_path)


@pytest.mark.parametrize(("row", "error"), [
    (faster_than_peer("run-gone"), "no result file bench/results/run-gone"),
    (Row("Routing", "theirs (#0)", "{p90(F, 'theirs')}", ("run-a",), verdict="measured"),
     "no contender theirs in bench/results/run-a"),
    (Row("Routing", "typo (#0)", "{p90(F, 'ours') +}", ("run-a",), verdict="measured"), "SyntaxError"),
    (Row("Routing", "no verdict (#0)", "{p90(F, 'ours')}", ("run-a",)), "neither met nor verdict"),
    (Row("Routing", "nothing read (#0)", "fast", ("run-a",), verdict="met"), "reads no result and names no note"),
    (Row("Routing", "dated twice (#0)", "{p90(F, 'ours')}", ("run-a",), verdict="met", date="2026-01-01"),
     "declares a date but its results record 2026-12-04"),
])
def test_a_row_the_results_cannot_back_is_refused_with_the_reason(tmp_path, row, error):
    routing_run(tmp_path, "run-a", {"ours": 0.3, "sglang-router-cache-aware": 0.9})

    with pytest.raises(StandingError, match=error):
        render([row], tmp_path, tmp_path)


def combined_run(root: Path, folder: str, ttfts: dict[str, list[list[float]]]) -> None:
    """A combined routing results.json: per contender one list of per-request TTFTs per run."""
    runs = []
    for i in range(len(next(iter(ttfts.values())))):
        results = [{"name": name, "verdict": "valid", "overall": {"ttft_p90": sorted(t[i])[int(0.9 * len(t[i]))]},
                    "samples": {"ttft": t[i]}} for name, t in ttfts.items()]
        runs.append({"scenario": "x", "scale": "small", "command": "python -m bench.routing run x",
                     "started": f"2026-12-0{i + 1} 10:00:00 UTC", "results": results})
    from bench.routing.combine import combined
    (root / folder).mkdir(parents=True)
    (root / folder / "results.json").write_text(json.dumps(combined(runs, "python -m bench.routing run x --repeats 3")))


def beats_peer(folder: str = "runs") -> Row:
    return Row("Routing", "ours beats the best peer (#0)", "{ci(vs(F, 'ours', best_peer(F)))}", (folder,),
               claims="[vs(F, 'ours', best_peer(F))]")


def ttfts(scale: float, seed: int, runs: int = 3) -> list[list[float]]:
    import random
    rng = random.Random(seed)
    return [[round(rng.expovariate(1 / scale), 4) for _ in range(300)] for _ in range(runs)]


def test_a_claim_whose_interval_clears_one_is_met(tmp_path):
    combined_run(tmp_path, "runs", {"ours": ttfts(0.1, 1), "vllm-router-kv-aware": ttfts(0.3, 2)})
    table = render([beats_peer()], tmp_path, tmp_path)
    assert "| met |" in table and ", 3 runs |" in table
    assert "`python -m bench.routing run x --repeats 3`" in table and "2026-12-03" in table  # the last run's date


def test_a_claim_whose_interval_includes_one_is_a_tie_not_a_win(tmp_path):
    # ours is a little faster in every run, but not by more than the requests and the runs scatter.
    combined_run(tmp_path, "runs", {"ours": ttfts(0.100, 3), "vllm-router-kv-aware": ttfts(0.103, 4)})
    table = render([beats_peer()], tmp_path, tmp_path)
    assert "**tie**: the 95 % interval of ours against vllm-router-kv-aware includes 1x" in table
    assert "| met |" not in table


def test_a_claim_on_fewer_than_three_runs_is_not_shown_however_large(tmp_path):
    combined_run(tmp_path, "runs", {"ours": ttfts(0.1, 5, runs=2), "vllm-router-kv-aware": ttfts(1.0, 6, runs=2)})
    assert "**not shown**: 2 runs with per-request samples, a claim needs 3" in render([beats_peer()], tmp_path, tmp_path)
    # A single run from before the samples were kept: no interval at all.
    routing_run(tmp_path, "old", {"ours": 0.1, "vllm-router-kv-aware": 1.0})
    table = render([beats_peer("old")], tmp_path, tmp_path)
    assert "no interval" in table and "**not shown**: 0 runs" in table


def test_a_target_ratio_and_a_lost_claim(tmp_path):
    combined_run(tmp_path, "runs", {"ours": ttfts(0.3, 7), "vllm-router-kv-aware": ttfts(0.1, 8)})
    assert "**not met**" in render([beats_peer()], tmp_path, tmp_path)
    row = Row("Routing", "ours 2x (#0)", "x", ("runs",), claims="[(vs(F, 'vllm-router-kv-aware', 'ours'), 2)]")
    assert "| met |" in render([row], tmp_path, tmp_path)  # 3x faster clears 2x
    both = Row("Routing", "both (#0)", "x", ("runs",), claims="[vs(F, 'ours', 'vllm-router-kv-aware')]", met="True")
    with pytest.raises(StandingError, match="claims and met"):
        render([both], tmp_path, tmp_path)
