"""`epp calibration`: the predicted-TTFT and -TPOT coefficients a running picker has learned, read from its /metrics."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

COLUMNS = (("prefill_seconds_per_token", "prefill µs/token", 1e6),
           ("queued_prefill_seconds_per_token", "queued prefill µs/token", 1e6),
           ("seconds_per_waiting_request", "queue ms/waiting req", 1e3),
           ("seconds_per_running_request", "running ms/req", 1e3),
           ("cpu_load_seconds_per_token", "cpu load µs/token", 1e6),
           ("disk_load_seconds_per_token", "disk load µs/token", 1e6),
           ("base_seconds", "base ms", 1e3))


def read_calibration(text: str) -> dict[tuple[str, str, str], dict[str, float]]:
    """Per (plugin, endpoint, model): learned terms, `observations`, `residual_seconds`, `resets`."""
    rows: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            key = (labels.get("plugin", ""), labels.get("endpoint", ""), labels.get("model", ""))
            if sample.name == "epp_ttft_calibration":
                rows[key][labels.get("term", "")] = sample.value
            elif sample.name == "epp_ttft_calibration_observations":
                rows[key]["observations"] = sample.value
            elif sample.name == "epp_ttft_calibration_residual_seconds":
                rows[key]["residual_seconds"] = sample.value
            elif sample.name == "epp_ttft_calibration_resets":
                rows[key]["resets"] = sample.value
    return dict(rows)


TPOT_COLUMNS = (("base_seconds_per_token", "TPOT base ms/token", 1e3),
                ("seconds_per_token_per_running_request", "per running req µs/token", 1e6))


def read_tpot_calibration(text: str) -> dict[tuple[str, str], dict[str, float]]:
    """Per (endpoint, model): learned TPOT terms, `observations`, `residual_seconds`."""
    rows: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            key = (labels.get("endpoint", ""), labels.get("model", ""))
            if sample.name == "epp_tpot_calibration":
                rows[key][labels.get("term", "")] = sample.value
            elif sample.name == "epp_tpot_calibration_observations":
                rows[key]["observations"] = sample.value
            elif sample.name == "epp_tpot_calibration_residual_seconds":
                rows[key]["residual_seconds"] = sample.value
    return dict(rows)


def _align(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines) + "\n"


def format_tpot_table(rows: dict[tuple[str, str], dict[str, float]]) -> str:
    """A plain-text table of the learned TPOT, one line per endpoint and model."""
    lines = [["endpoint", "model", *(title for _, title, _ in TPOT_COLUMNS), "observed", "error ms"]]
    for (endpoint, model), values in sorted(rows.items()):
        lines.append([endpoint, model, *(f"{values.get(term, float('nan')) * unit:.3g}" for term, _, unit in TPOT_COLUMNS),
                      f"{values.get('observations', 0):.0f}", f"{values.get('residual_seconds', 0) * 1e3:.2f}"])
    return _align(lines)


def format_table(rows: dict[tuple[str, str, str], dict[str, float]]) -> str:
    """A plain-text table, one line per endpoint and model."""
    header = ["plugin", "endpoint", "model", *(title for _, title, _ in COLUMNS), "observed", "error ms", "resets"]
    lines = [header]
    for (plugin, endpoint, model), values in sorted(rows.items()):
        lines.append([plugin, endpoint, model,
                      *(f"{values.get(term, float('nan')) * unit:.3g}" for term, _, unit in COLUMNS),
                      f"{values.get('observations', 0):.0f}", f"{values.get('residual_seconds', 0) * 1e3:.1f}",
                      f"{values.get('resets', 0):.0f}"])
    return _align(lines)


def calibration_main(url: str, timeout: float = 5.0) -> int:
    """Print the picker's learned TTFT and TPOT calibration; exit 1 when it cannot be read or holds none."""
    if "://" not in url:
        url = f"http://{url}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (the user's own picker)
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"epp calibration: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    rows = read_calibration(text)
    tpot = read_tpot_calibration(text)
    if not rows and not tpot:
        print(f"epp calibration: {url} has no predicted-TTFT calibration yet (no predicted-ttft-scorer with "
              "calibrate: true, or no streamed request has completed)", file=sys.stderr)
        return 1
    if rows:
        sys.stdout.write(format_table(rows))
    if tpot:
        sys.stdout.write(("\n" if rows else "") + "Time per output token (streamed responses):\n"
                         + format_tpot_table(tpot))
    return 0
