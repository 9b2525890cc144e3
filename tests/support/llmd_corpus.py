"""Run `epp check-config` over a folder of llm-d router configs and route a request through each that loads.

    .venv/bin/python -m tests.support.llmd_corpus CORPUS/files CORPUS/templates [--manifest CORPUS/manifest.tsv]
        [--markdown]

CORPUS is a folder of configs and Helm values files (llm-d's guides and samples, kept outside the
project: third-party text). Every config is loaded as `epp check-config` loads it; each one that
loads is then served: the real director schedules a chat request over a pool of four simulated
endpoints (decode, prefill, both, unlabelled). Prints one line per config (outcome, routing, reason),
then the count. `--manifest` (tab-separated: repo, path, commit, local_copy) adds each file's source;
`--markdown` prints the table docs/run-in-place-of-llm-d.md carries.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from epp.config.check import LOADS, MAPS, REFUSED, TEMPLATE, Outcome, check_paths
from epp.framework import ConfigError, Endpoint, InferenceError
from tests.support.scheduling import DirectorHarness, endpoint, request

ROLE = "llm-d.ai/role"
ROUTE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Row:
    """One config's outcome and, when it loaded, what routing a request through it gave."""

    outcome: Outcome
    routed: str  # "routed to <endpoint>", "no endpoint: <why>", "error: <why>", or "" when not loaded

    @property
    def ok(self) -> bool:
        return self.outcome.status in (LOADS, MAPS) and not self.routed.startswith("error")


def _text(outcome: Outcome) -> str:
    if outcome.config.text is not None:
        return outcome.config.text
    with open(outcome.config.file, encoding="utf-8") as fh:
        return fh.read()


def _pool(harness: DirectorHarness) -> list[Endpoint]:
    """Four endpoints, scraped just now; a DisaggregatedSet's labels when a rollout screener looks for them."""
    extra: dict[str, str] = {}
    roles: dict[int, str] = {}
    role_label = ""
    for entry in harness.loaded.plugins:  # the rollout screener keeps one revision whose roles cover the request
        plugin = entry.plugin
        if hasattr(plugin, "revision_label") and hasattr(plugin, "scope"):
            extra.update(plugin.scope)
            extra[plugin.revision_label] = "r1"
            roles = {0: "decode", 1: "prefill", 2: "decode", 3: "prefill"}
            role_label = plugin.role_label
    pool = [endpoint(0, labels={ROLE: "decode"}), endpoint(1, labels={ROLE: "prefill"}),
            endpoint(2, queue=1, labels={ROLE: "both"}), endpoint(3, kv=0.2)]
    now = time.monotonic()
    fresh = []
    for i, ep in enumerate(pool):
        labels = {**ep.labels, **extra, **({role_label: roles[i]} if roles else {})}
        fresh.append(dataclasses.replace(ep, labels=labels, metrics=dataclasses.replace(ep.metrics, update_time=now)))
    return fresh


async def _route(text: str, label: str) -> str:
    harness = DirectorHarness(text, source=label)
    pool = _pool(harness)
    prompt = "You are a helpful assistant. " * 40 + "Summarise the llm-d router in one line."
    result, state = await asyncio.wait_for(harness.pick(request(prompt, model="my-model"), pool), ROUTE_TIMEOUT_S)
    if not result.targets:
        return "no endpoint: the pool's labels fit none of its filters"
    harness.answer(state, request(prompt, model="my-model"), result)
    return f"routed to {result.targets[0].hostport}"


def route(outcome: Outcome) -> str:
    """Serve one request through a config that loaded (a fresh pipeline built from its text)."""
    if outcome.status not in (LOADS, MAPS):
        return ""
    try:
        return asyncio.run(_route(_text(outcome), outcome.config.label))
    except ConfigError as exc:
        return f"error: {str(exc).splitlines()[0]}"
    except InferenceError as exc:  # the picker's own answer (429, 503): it served the request, with no endpoint
        return f"no endpoint: {exc.body}"
    except Exception as exc:  # noqa: BLE001 - every failure is reported, one line per config
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def run(paths: Sequence[str]) -> list[Row]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config naming a hub tokenizer must not wait on the network
    outcomes, _without = check_paths(paths)
    return [Row(o, route(o)) for o in outcomes]


def sources(manifest: str | None) -> dict[str, tuple[str, str, str]]:
    """local copy -> (repo, path, commit), from the manifest (local copies relative to its folder)."""
    if not manifest:
        return {}
    found: dict[str, tuple[str, str, str]] = {}
    with open(manifest, encoding="utf-8") as fh:
        for rec in csv.DictReader(fh, delimiter="\t"):
            local = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(manifest)), rec["local_copy"]))
            found[local] = (rec["repo"], rec["path"], rec["commit"])
    return found


CELL_NOTICE_CHARS = 160  # a notice in the docs table; `epp check-config` prints it whole


def _reason(row: Row) -> str:
    o = row.outcome
    if o.status == MAPS:
        return " / ".join(n if len(n) <= CELL_NOTICE_CHARS else n[:CELL_NOTICE_CHARS - 1].rstrip() + "…"
                          for n in o.notices)
    return o.detail


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def print_markdown(rows: Sequence[Row], src: dict[str, tuple[str, str, str]]) -> None:
    print("| source (repo:path at commit) | config | outcome | reason |")
    print("|---|---|---|---|")
    for row in rows:
        c = row.outcome.config
        repo, path, commit = src.get(os.path.normpath(os.path.abspath(c.file)), ("", c.file, ""))
        where = f"`{repo}:{path}` at `{commit[:12]}`" if repo else f"`{path}`"
        key = f"`{c.key}`" if c.key else "(whole file)"
        print(f"| {where} | {key} | {row.outcome.status} | {_cell(_reason(row))} |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="corpus folders or files")
    parser.add_argument("--manifest", help="manifest.tsv (repo, path, commit, local_copy: relative to its folder)")
    parser.add_argument("--markdown", action="store_true", help="print the docs table instead of lines")
    args = parser.parse_args(argv)
    rows = run(args.paths)
    if args.markdown:
        print_markdown(rows, sources(args.manifest))
    else:
        for row in rows:
            routed = f" [{row.routed}]" if row.routed else ""
            print(f"{row.outcome.line()}{routed}")
    counts = {s: sum(1 for r in rows if r.outcome.status == s) for s in (LOADS, MAPS, REFUSED, TEMPLATE)}
    served = sum(1 for r in rows if r.routed.startswith("routed"))
    errors = [r for r in rows if r.routed.startswith("error")]
    checked = len(rows) - counts[TEMPLATE]
    good = counts[LOADS] + counts[MAPS] - len(errors)
    share = 100.0 * good / checked if checked else 0.0
    print(f"{len(rows)} config(s): {counts[LOADS]} load, {counts[MAPS]} map with notices, {counts[REFUSED]} refused, "
          f"{counts[TEMPLATE]} template(s) set aside; {served} routed a request, {len(errors)} failed to; "
          f"{good}/{checked} = {share:.1f} % load and serve", file=sys.stderr if args.markdown else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
