"""bench/results keeps what a reader needs: at most RESULT_FILES_BUDGET files (raw records and logs stay out)."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
# Issue 41: the folder had grown to 243 files, most of them superseded runs. A new result replaces
# the one it supersedes (git keeps the old one), so the folder stays readable.
RESULT_FILES_BUDGET = 200
# Written by every run, ignored by git (.gitignore): not results.
IGNORED_FOLDERS = {"raw", "logs"}


def result_files(root: Path) -> list[Path]:
    """Every file under `root` outside the per-request records and process logs."""
    return [p for p in root.rglob("*") if p.is_file() and not IGNORED_FOLDERS & set(p.relative_to(root).parts[:-1])]


def test_the_results_folder_stays_within_its_budget():
    files = result_files(RESULTS)
    assert len(files) <= RESULT_FILES_BUDGET, (
        f"{len(files)} files under bench/results (budget {RESULT_FILES_BUDGET}): delete the runs no row of the "
        "standing and no current note cites (bench/README.md, 'Adding or updating a row')")


def test_raw_records_and_logs_do_not_count(tmp_path):
    (tmp_path / "run" / "raw").mkdir(parents=True)
    (tmp_path / "run" / "logs" / "epp-approx").mkdir(parents=True)
    (tmp_path / "run" / "report.md").write_text("r")
    (tmp_path / "run" / "raw" / "epp-approx.jsonl").write_text("{}")
    (tmp_path / "run" / "logs" / "epp-approx" / "epp.log").write_text("log")
    assert [p.name for p in result_files(tmp_path)] == ["report.md"]
