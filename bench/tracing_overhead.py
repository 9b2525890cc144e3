"""What tracing costs the picker per request: off, on with every request sampled, on with none sampled.

The in-process bench (`bench/extproc_inproc.py`: the picker's own Python work per request, no
gRPC, default config over 16 endpoints, 4 KB prompts) run with three tracings, alternating in
rounds so that a busy machine slows all three alike; each one's figure is its best round. "On"
exports through the SDK's batch processor into an exporter that encodes each batch as OTLP
protobuf and drops the bytes: the picker's CPU for spans and their encoding, not the network's.
Process CPU time counts the batch processor's thread too.

`--before DIR` also runs `bench/extproc_inproc.py` of another checkout (one without tracing, e.g.
`git worktree add DIR <commit>`) and of this one as processes, alternately: what the hooks cost
with tracing off.

    python bench/tracing_overhead.py --requests 3000 --rounds 3 --before /tmp/epp-before \
        --out bench/results/tracing-overhead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extproc_cpu import MODES  # noqa: E402
from extproc_inproc import measure  # noqa: E402
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler  # noqa: E402

from epp.tracing import RequestTracing  # noqa: E402


class EncodingExporter(SpanExporter):
    """Encodes each batch as an OTLP export request (what an OTLP exporter sends) and drops it."""

    def __init__(self) -> None:
        self.spans = 0
        self.bytes = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        self.bytes += len(encode_spans(spans).SerializeToString())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def tracing_with(sampler: Sampler) -> tuple[RequestTracing, EncodingExporter, TracerProvider]:
    exporter = EncodingExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return RequestTracing(provider), exporter, provider


REPO = Path(__file__).resolve().parents[1]


def inproc_us(checkout: Path, requests: int) -> dict[str, float]:
    """CPU µs per request by response mode, from `bench/extproc_inproc.py` of `checkout` run as a process."""
    out = subprocess.run([sys.executable, str(checkout / "bench" / "extproc_inproc.py"), "--requests", str(requests)],
                         cwd=checkout, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout
    by_label = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| ([^|]+?) \| (\d+) \|", out, re.M)}
    return {mode: by_label[label] for mode, label in MODES.items()}


def compare_before(before: Path, requests: int, rounds: int) -> dict[str, dict[str, float]]:
    """Best µs per request by mode of this checkout and of `before`, measured alternately."""
    best: dict[str, dict[str, float]] = {"this checkout, tracing off": {}, f"{before}": {}}
    for _ in range(rounds):
        for label, checkout in (("this checkout, tracing off", REPO), (f"{before}", before)):
            for mode, us in inproc_us(checkout, requests).items():
                best[label][mode] = min(best[label].get(mode, float("inf")), us)
    return best


async def run(requests: int, rounds: int, modes: list[str]) -> dict:
    configs = {"off": None, "on, every request sampled": ALWAYS_ON, "on, no request sampled": ALWAYS_OFF}
    best: dict[str, dict[str, float]] = {mode: {} for mode in modes}
    spans_per_request: dict[str, float] = {}
    for _ in range(rounds):
        for mode in modes:
            for label, sampler in configs.items():
                if sampler is None:
                    us, _shares = await measure(requests, mode)
                else:
                    tracing, exporter, provider = tracing_with(sampler)
                    us, _shares = await measure(requests, mode, tracing=tracing)
                    provider.shutdown()  # exports what is left
                    if sampler is ALWAYS_ON:
                        # measure() runs 200 warm-up requests, then `requests` (rounded to whole batches).
                        spans_per_request[mode] = exporter.spans / (200 + requests // 20 * 20)
                best[mode][label] = min(best[mode].get(label, float("inf")), us)
    return {"requests": requests, "rounds": rounds, "cpu_us_per_request": best,
            "spans_per_request": spans_per_request,
            "ratio_to_off": {mode: {label: us / best[mode]["off"] for label, us in row.items()}
                             for mode, row in best.items()}}


def report(result: dict) -> str:
    lines = [f"{result['requests']} requests per measurement, best of {result['rounds']} alternating rounds, "
             "in-process (bench/extproc_inproc.py), default config, 16 endpoints, 4 KB prompts", "",
             "| response mode | tracing | CPU µs / request | ratio to off | spans / request |", "|---|---|---|---|---|"]
    for mode, row in result["cpu_us_per_request"].items():
        for label, us in row.items():
            spans = f"{result['spans_per_request'][mode]:.1f}" if label.startswith("on, every") else ""
            lines.append(f"| {MODES[mode]} | {label} | {us:.0f} | {result['ratio_to_off'][mode][label]:.2f} | "
                         f"{spans} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="full,none", help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--before", type=Path, help="a checkout without tracing: compare the off path with it")
    parser.add_argument("--out", type=Path, help="folder for report.md and results.json")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or not set(modes) <= set(MODES):
        parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}")
    result = asyncio.run(run(args.requests, args.rounds, modes))
    text = report(result)
    if args.before is not None:
        result["before"] = compare_before(args.before.resolve(), args.requests, args.rounds)
        ours, theirs = result["before"].values()
        text += ("\nThe hooks with tracing off, against a checkout without them (`bench/extproc_inproc.py` of each, "
                 "as processes, alternately, best of each):\n\n| response mode | this checkout, off | "
                 f"{args.before} | ratio |\n|---|---|---|---|\n")
        text += "".join(f"| {MODES[mode]} | {ours[mode]:.0f} | {theirs[mode]:.0f} | {ours[mode] / theirs[mode]:.3f} |\n"
                        for mode in MODES)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(f"# Tracing's cost per request\n\n{text}")
        (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
