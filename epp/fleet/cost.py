"""`epp cost`: what a window of the picker's token counters cost, and what cached tokens saved.

Input cost follows the usual pricing of cached input: T x ((1 - H) x Pi + H x Pc), with T the
prompt tokens, H the cached share, Pi the input price and Pc the cached-input price. Cached
tokens come from the servers' usage (`cached_tokens`); they are split over the GPU, CPU and disk
tiers in the proportions the picker predicted (the usage does not say which tier served them),
so each tier can carry its own price. Prompt tokens whose usage had no details are priced as
computed. Saved = cached tokens x (Pi - Pc): the difference to computing every prompt token.

The window is the difference of two scrapes of the picker's `/metrics`: two files (`--before`,
`--after`), one file (everything since the picker started), or a live URL scraped twice
`--window` seconds apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from epp.fleet.accounting import TIERS

COUNTERS = {
    "epp_prompt_tokens_reported_total": "kind",
    "epp_prompt_tokens_predicted_total": "tier",
    "epp_output_tokens_total": None,
}
Key = tuple[str, str]  # (model, tenant)


@dataclass(frozen=True)
class ModelPrices:
    """Prices per `unit_tokens` tokens: input (computed), cached input by tier, and output."""

    input: float
    cached: Mapping[str, float]
    output: float


@dataclass(frozen=True)
class PriceTable:
    """Prices per model, with a default for models not listed."""

    default: ModelPrices
    models: Mapping[str, ModelPrices] = field(default_factory=dict)
    unit_tokens: float = 1_000_000
    currency: str = "USD"

    def for_model(self, model: str) -> ModelPrices:
        return self.models.get(model, self.default)


class PriceError(ValueError):
    """A price file that cannot be used; the message names the field."""


def _price(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise PriceError(f"{where}: must be a number >= 0, got {value!r}")
    return float(value)


def _model_prices(raw: Any, where: str, fallback: ModelPrices | None) -> ModelPrices:
    if not isinstance(raw, Mapping):
        raise PriceError(f"{where}: must be a mapping with input, cached, output")
    unknown = set(raw) - {"input", "cached", "output"}
    if unknown:
        raise PriceError(f"{where}: unknown fields {sorted(unknown)}; allowed: input, cached, output")
    for key in ("input", "cached", "output"):
        if key not in raw and fallback is None:
            raise PriceError(f"{where}.{key}: required")
    # A field left out takes the fallback's price (without a fallback it was required above).
    input_price = _price(raw["input"], f"{where}.input") if "input" in raw or fallback is None else fallback.input
    output = _price(raw["output"], f"{where}.output") if "output" in raw or fallback is None else fallback.output
    if "cached" not in raw and fallback is not None:
        cached = dict(fallback.cached)
    elif isinstance(raw["cached"], Mapping):
        bad = set(raw["cached"]) - set(TIERS)
        if bad:
            raise PriceError(f"{where}.cached: unknown tiers {sorted(bad)}; allowed: {', '.join(TIERS)}")
        missing = set(TIERS) - set(raw["cached"])
        if missing:
            raise PriceError(f"{where}.cached: missing tiers {sorted(missing)} (or give one number for all)")
        cached = {t: _price(raw["cached"][t], f"{where}.cached.{t}") for t in TIERS}
    else:
        one = _price(raw["cached"], f"{where}.cached")
        cached = {t: one for t in TIERS}
    return ModelPrices(input_price, cached, output)


def load_prices(doc: Any, source: str = "<prices>") -> PriceTable:
    """A price table from a parsed YAML/JSON document (see the module docstring for the shape)."""
    if not isinstance(doc, Mapping):
        raise PriceError(f"{source}: must be a mapping with default (and models)")
    unknown = set(doc) - {"default", "models", "unit_tokens", "currency"}
    if unknown:
        raise PriceError(f"{source}: unknown fields {sorted(unknown)}; allowed: default, models, unit_tokens, currency")
    if "default" not in doc:
        raise PriceError(f"{source}: default: required")
    default = _model_prices(doc["default"], f"{source}: default", None)
    models_raw = doc.get("models") or {}
    if not isinstance(models_raw, Mapping):
        raise PriceError(f"{source}: models: must map model names to prices")
    models = {str(name): _model_prices(raw, f"{source}: models.{name}", default) for name, raw in models_raw.items()}
    unit = _price(doc.get("unit_tokens", 1_000_000), f"{source}: unit_tokens")
    if unit <= 0:
        raise PriceError(f"{source}: unit_tokens: must be > 0")
    return PriceTable(default, models, unit, str(doc.get("currency", "USD")))


def read_counters(exposition: str) -> dict[tuple[str, Key, str], float]:
    """The token counters of one `/metrics` page: (counter, (model, tenant), kind/tier) -> value."""
    out: dict[tuple[str, Key, str], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name not in COUNTERS:
                continue
            sub = COUNTERS[sample.name]
            key = (sample.labels.get("model", ""), sample.labels.get("tenant", ""))
            part = sample.labels.get(sub, "") if sub else ""
            out[(sample.name, key, part)] = out.get((sample.name, key, part), 0.0) + sample.value
    return out


def window_counters(before: Mapping[tuple[str, Key, str], float],
                    after: Mapping[tuple[str, Key, str], float]) -> dict[tuple[str, Key, str], float]:
    """Counter increases from `before` to `after`; a counter that went down was reset, so it counts from 0."""
    out = {}
    for k, v in after.items():
        start = before.get(k, 0.0)
        out[k] = v - start if v >= start else v
    return out


@dataclass
class CostLine:
    """Tokens and money of one (model, tenant) group over the window."""

    model: str
    tenant: str
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    computed_tokens: float = 0.0
    unknown_tokens: float = 0.0
    cached_by_tier: dict[str, float] = field(default_factory=dict)
    predicted_cached: float = 0.0
    predicted_prompt: float = 0.0
    output_tokens: float = 0.0
    input_cost: float = 0.0
    output_cost: float = 0.0
    uncached_cost: float = 0.0
    saved: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Reported cached share of the prompt tokens whose usage said so."""
        known = self.cached_tokens + self.computed_tokens
        return self.cached_tokens / known if known else 0.0

    @property
    def predicted_hit_rate(self) -> float:
        return self.predicted_cached / self.predicted_prompt if self.predicted_prompt else 0.0


def cost_lines(window: Mapping[tuple[str, Key, str], float], prices: PriceTable, *,
               by_tenant: bool = False) -> list[CostLine]:
    """Apply the prices to a window of counters, one line per model (or per model and tenant)."""
    lines: dict[Key, CostLine] = {}
    predicted: dict[Key, dict[str, float]] = {}
    for (name, (model, tenant), part), value in window.items():
        key = (model, tenant if by_tenant else "")
        line = lines.setdefault(key, CostLine(*key))
        if name == "epp_prompt_tokens_reported_total":
            if part == "cached":
                line.cached_tokens += value
            elif part == "computed":
                line.computed_tokens += value
            else:
                line.unknown_tokens += value
        elif name == "epp_prompt_tokens_predicted_total":
            predicted.setdefault(key, {}).setdefault(part, 0.0)
            predicted[key][part] += value
        else:
            line.output_tokens += value
    for key, line in lines.items():
        tiers = predicted.get(key, {})
        line.predicted_cached = sum(tiers.get(t, 0.0) for t in TIERS)
        line.predicted_prompt = line.predicted_cached + tiers.get("computed", 0.0)
        line.prompt_tokens = line.cached_tokens + line.computed_tokens + line.unknown_tokens
        if line.predicted_cached > 0:
            line.cached_by_tier = {t: line.cached_tokens * tiers.get(t, 0.0) / line.predicted_cached for t in TIERS}
        else:
            line.cached_by_tier = {"gpu": line.cached_tokens, "cpu": 0.0, "disk": 0.0}
        p = prices.for_model(line.model)
        unit = prices.unit_tokens
        cached_cost = sum(line.cached_by_tier[t] * p.cached[t] for t in TIERS)
        line.input_cost = ((line.computed_tokens + line.unknown_tokens) * p.input + cached_cost) / unit
        line.uncached_cost = line.prompt_tokens * p.input / unit
        line.saved = line.uncached_cost - line.input_cost
        line.output_cost = line.output_tokens * p.output / unit
    return sorted(lines.values(), key=lambda ln: (ln.model, ln.tenant))


def total_line(lines: Sequence[CostLine]) -> CostLine:
    """The sum of every line (hit rates recomputed from the sums)."""
    total = CostLine("TOTAL", "")
    for ln in lines:
        for attr in ("prompt_tokens", "cached_tokens", "computed_tokens", "unknown_tokens", "predicted_cached",
                     "predicted_prompt", "output_tokens", "input_cost", "output_cost", "uncached_cost", "saved"):
            setattr(total, attr, getattr(total, attr) + getattr(ln, attr))
        for t, v in ln.cached_by_tier.items():
            total.cached_by_tier[t] = total.cached_by_tier.get(t, 0.0) + v
    return total


def render(lines: Sequence[CostLine], prices: PriceTable, *, by_tenant: bool, seconds: float | None) -> str:
    """The report as a plain-text table."""
    cur = prices.currency
    head = ["model"] + (["tenant"] if by_tenant else []) + [
        "prompt tok", "cached", "H", "H pred", "gpu/cpu/disk", "output tok",
        f"input {cur}", f"output {cur}", f"no-cache {cur}", f"saved {cur}"]
    rows = []
    for ln in [*lines, total_line(lines)] if lines else []:
        tiers = "/".join(f"{ln.cached_by_tier.get(t, 0.0):.0f}" for t in TIERS)
        rows.append([ln.model or '""'] + ([ln.tenant] if by_tenant else []) + [
            f"{ln.prompt_tokens:.0f}", f"{ln.cached_tokens:.0f}", f"{ln.hit_rate:.1%}", f"{ln.predicted_hit_rate:.1%}",
            tiers, f"{ln.output_tokens:.0f}", f"{ln.input_cost:.4f}", f"{ln.output_cost:.4f}",
            f"{ln.uncached_cost:.4f}", f"{ln.saved:.4f}"])
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [head, *rows]]
    window = f" over {seconds:g} s" if seconds is not None else ""
    if lines:
        total = total_line(lines)
        spent = total.input_cost + total.output_cost
        out.append(f"spent {spent:.4f} {cur}{window} (input {total.input_cost:.4f}, output {total.output_cost:.4f}); "
                   f"caching saved {total.saved:.4f} {cur} ({total.saved / total.uncached_cost:.1%} of the input cost "
                   f"without cache)" if total.uncached_cost else f"spent {spent:.4f} {cur}{window}")
    else:
        out.append("no token counters in the window")
    return "\n".join(out) + "\n"


def _scrape(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - an operator-given URL
        return resp.read().decode("utf-8", "replace")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `epp cost`."""
    p = argparse.ArgumentParser(prog="epp cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--prices", required=True, help="YAML/JSON price file (default, models, unit_tokens, currency)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--metrics-url", help="the picker's /metrics URL, scraped twice --window seconds apart")
    src.add_argument("--after", help="a saved /metrics page at the end of the window")
    p.add_argument("--before", help="a saved /metrics page at the start of the window (with --after)")
    p.add_argument("--window", type=float, default=60.0, help="seconds between the two live scrapes (default 60)")
    p.add_argument("--by-tenant", action="store_true", help="one line per model and tenant")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.before and not args.after:
        p.error("--before needs --after")
    try:
        with open(args.prices, encoding="utf-8") as fh:
            prices = load_prices(yaml.safe_load(fh), args.prices)
    except (OSError, yaml.YAMLError, PriceError) as exc:
        print(f"epp cost: --prices: {exc}", file=sys.stderr)
        return 2
    seconds: float | None = None
    try:
        if args.metrics_url:
            before = read_counters(_scrape(args.metrics_url))
            time.sleep(args.window)
            after = read_counters(_scrape(args.metrics_url))
            seconds = args.window
        else:
            before = {}
            if args.before:
                with open(args.before, encoding="utf-8") as fh:
                    before = read_counters(fh.read())
            with open(args.after, encoding="utf-8") as fh:
                after = read_counters(fh.read())
    except (OSError, ValueError) as exc:
        print(f"epp cost: cannot read the counters: {exc}", file=sys.stderr)
        return 2
    lines = cost_lines(window_counters(before, after), prices, by_tenant=args.by_tenant)
    if args.json:
        total = total_line(lines) if lines else None
        doc = {"currency": prices.currency, "window_seconds": seconds,
               "lines": [_line_json(ln) for ln in lines], "total": _line_json(total) if total else None}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(render(lines, prices, by_tenant=args.by_tenant, seconds=seconds))
    return 0


def _line_json(ln: CostLine) -> dict[str, Any]:
    return {"model": ln.model, "tenant": ln.tenant, "prompt_tokens": ln.prompt_tokens,
            "cached_tokens": ln.cached_tokens, "computed_tokens": ln.computed_tokens,
            "unknown_tokens": ln.unknown_tokens, "cached_by_tier": ln.cached_by_tier,
            "hit_rate": ln.hit_rate, "predicted_hit_rate": ln.predicted_hit_rate,
            "output_tokens": ln.output_tokens, "input_cost": ln.input_cost, "output_cost": ln.output_cost,
            "uncached_input_cost": ln.uncached_cost, "saved": ln.saved}
