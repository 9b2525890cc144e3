"""The registry of experiments: contender variants built to answer one question, apart from the comparison.

`contenders.CONTENDERS` holds what a comparison runs: the pipelines we recommend, the references
(round-robin, random, a minimal picker) and the peers. Everything else lives here, one family per
question: a "before" of a change (GIE's random ties, queue-scorer on whole requests only,
scrape-only load scorers), a deployment shape (workers, pods, the rendezvous home), a knob
(scrape intervals, response modes, the approximate index's sizing) or a yardstick (the oracle
that is handed the simulator's costs, the same pipeline twice). Each family says what it asked
and where the answer is written (a note under bench/notes). Name any of them with `--contenders`:

    python -m bench.routing run shared-prefix --contenders epp-approx,epp-approx-random-ties
    python -m bench.routing list        # the contenders, then the experiments by family

An experiment is never part of `--contenders all` and never a row of the current standing
unless a row names it (as the scale-out rows name the worker and pod shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.routing.contenders import CONTENDERS, ORACLE_LABEL, Contender


@dataclass(frozen=True)
class Family:
    """Experiments that answer one question, and where the answer is written."""

    question: str
    note: str  # "file.md#anchor" under bench/notes
    contenders: tuple[Contender, ...]


# Name suffix, `--workers`, pods: one picker, two workers, two pods (the shapes the "before" variants ran in).
_PICKER_SHAPES = (("", 1, 1), ("-w2", 2, 1), ("-pods2", 1, 2))
_PREFIXES = ("approx", "precise")


def _x(name: str, variant: str, description: str, **kw: object) -> Contender:
    """An epp experiment (never in `--contenders all`)."""
    return Contender(name, "epp", variant, description, default=False, **kw)  # type: ignore[arg-type]


def _ttft_variants(suffix: str, description: str) -> tuple[Contender, ...]:
    """`epp-approx-ttft-<suffix>` and `epp-precise-ttft-<suffix>`: the two `-ttft` pipelines with one variant suffix."""
    return tuple(_x(f"{base}-{suffix}", f"{variant}+{suffix}", description.format(base))
                 for base, variant in (("epp-approx-ttft", "sample:approximate"), ("epp-precise-ttft", "precise-ttft")))


FAMILIES: tuple[Family, ...] = (
    Family("Does the in-flight ledger matter? GIE's scrape-only load scorers and approximate producer (the before)",
           "2026-12-routing-issue10-round1.md#routing-that-wins-on-real-traffic-in-flight-accounting-self-calibrating-"
           "ttft-issue-10", (
               _x("epp-approx-scrape-only", "approx+scrape-only",
                  "before: GIE default with GIE's approximate producer and scrape-only load scorers"),
               _x("epp-precise-scrape-only", "precise+scrape-only", "before: epp-precise with scrape-only load scorers"),
           )),
    Family("How close does self-calibration get to a predictor handed the true costs? (a yardstick, never a peer "
           "comparison)",
           "2026-12-routing-issue10-round1.md#self-calibration-against-the-simulators-true-prefill-cost", (
               _x("epp-precise-ttft-oracle", "precise-ttft-oracle",
                  ORACLE_LABEL + "predicted-TTFT with the simulator profile's prefill cost"),
           )),
    Family("What a pick displaces: the predicted-TTFT scorer without the expected recompute of the prefixes its "
           "new blocks evict (the before of issue 42, which hot-spotted on full KV caches)",
           "2026-12-capacity-aware-prediction.md#the-cause-measured-per-pick",
           _ttft_variants("no-displacement", "before: {} with displacementWeight: 0")),
    Family("Gaps within the prediction's typical error: the predicted-TTFT scorer ranking on every gap (the before "
           "of round 4's multi-turn fix, which sent new conversations to the replica whose fit drifted lowest)",
           "2026-12-round4-measurements.md#multi-turn-moves-42", _ttft_variants("exact-ties", "before: {} with tiesWithinError: false")),
    Family("Stickiness that pays: the predicted-TTFT scorer charging a move the recompute of the history it leaves "
           "(stickiness: 1), against multi-turn conversations drifting between replicas",
           "2026-12-round4-measurements.md#multi-turn-moves-42", _ttft_variants("sticky", "{} with stickiness: 1")),
    Family("The picker's own in-flight count instead of the scraped queue",
           "2026-11-routing-first-runs-issue6.md#update-predicted-ttft-books-its-own-picks", (
               _x("epp-precise-active", "precise-active", "our EPP: precise prefix 3, active-request (in-flight) 2, kv 2"),
           )),
    Family("Does GIE's head-first eviction of the approximate index lose hits? (chainAware: false, the before)",
           "2026-12-routing-issue10-round2.md#why-our-approximate-matching-lost-hits-on-multi-turn", (
               _x("epp-approx-ttft-head-first", "sample:approximate+head-first-index",
                  "epp-approx-ttft with the approximate index as GIE keeps it (chainAware: false; a chain's head "
                  "evicted first)"),
           )),
    Family("Ties on whole requests: queue-scorer without the prefill-backlog tie-break (the before)",
           "2026-12-routing-issue10-round2.md#ties-on-whole-requests-queue-scorer-reads-the-backlog-too", tuple(
               _x(f"epp-{prefix}-no-tie-break", f"{prefix}+no-tie-break",
                  f"before: epp-{prefix} with queue-scorer on whole requests only (no prefill-backlog tie-break)")
               for prefix in _PREFIXES)),
    Family("Where a new prefix goes when nothing else decides: GIE's random ties against the most free prefix cache",
           "2026-12-routing-issue10-round2.md#ties-where-a-new-prefix-goes-when-nothing-else-decides-issue-10-round-2-"
           "session-6", tuple(
               _x(f"epp-{prefix}{pickers}-random-ties", f"{prefix}+random-ties",
                  f"before: epp-{prefix}{pickers} with max-score-picker's ties broken at random (GIE), not by the "
                  "most free prefix cache", workers=workers, pods=pods)
               for prefix in _PREFIXES for pickers, workers, pods in (*_PICKER_SHAPES, ("-pods4", 1, 4)))),
    Family("Several pickers against one: workers sharing decisions over the peer link, separate pods",
           "2026-12-pickers-and-cost-issue14-round2-s7-s13.md#every-multi-picker-cell-five-scrape-timings-each", (
               *(_x(f"epp-{prefix}-w{n}", prefix, f"epp-{prefix} with --workers {n} (pickers sharing decisions)",
                    workers=n) for prefix in _PREFIXES for n in (2, 4)),
               *(_x(f"epp-{prefix}-pods{n}", prefix,
                    f"epp-{prefix} as {n} pods: separate `epp serve` processes, peers of each other, one Envoy "
                    "ext_proc cluster", pods=n) for prefix in _PREFIXES for n in (2, 4)),
           )),
    Family("Pickers that share the scraping against every picker scraping every replica (the before)",
           "2026-12-pickers-and-cost-issue14-round2-s7-s13.md#pickers-share-the-scraping", tuple(
               _x(f"epp-{prefix}-{shape}-all-scrape", prefix,
                  f"before: epp-{prefix}-{shape} with every picker scraping every replica (`--no-shared-scrapes`)",
                  workers=workers, pods=pods, serve_args=("--no-shared-scrapes",))
               for prefix in _PREFIXES for shape, workers, pods in (("w4", 4, 1), ("pods4", 1, 4)))),
    Family("The rendezvous home for pickers with peers (rendezvousHome, off by default since round 2, session 5)",
           "2026-12-cost-and-pickers-issue14-round2-s4-s6.md#several-pickers-the-load-generators-arrivals-and-the-"
           "rendezvous-home-issue-14-round-2-session-5", (
               *(_x(f"epp-{prefix}{pickers}-{suffix}", f"{prefix}+{suffix}",
                    f"epp-{prefix}{pickers} with rendezvousHome: {on}", workers=workers, pods=pods)
                 for prefix in _PREFIXES for pickers, workers, pods in _PICKER_SHAPES
                 for suffix, on in (("no-home", "false"), ("home", "true")) if pickers or suffix == "no-home"),
               _x("epp-approx-pods4-home", "approx+home", "epp-approx-pods4 with rendezvousHome: true", pods=4),
           )),
    Family("The picker without response bodies (`epp envoy-config --responses headers`), and slower scrapes with it",
           "2026-12-pickers-and-cost-issue14-round2-s7-s13.md#response-modes-the-picker-without-response-bodies-"
           "issue-14-round-2-session-8", (
               _x("epp-approx-headers", "approx",
                  "epp-approx with `epp envoy-config --responses headers`: no response body crosses gRPC",
                  responses="headers"),
               _x("epp-precise-headers", "precise", "epp-precise with `--responses headers`", responses="headers"),
               Contender("minimal-picker-headers", "minimal-picker", "", "minimal-picker with `--responses headers`",
                         default=False, responses="headers"),
               *(_x(f"epp-{prefix}-headers-scrape{ms}", prefix,
                    f"epp-{prefix}-headers scraping every {ms} ms (`--refresh-metrics-interval`)",
                    responses="headers", serve_args=("--refresh-metrics-interval", f"{ms / 1000:g}"))
                 for prefix in _PREFIXES for ms in (200, 500)),
           )),
    Family("What GIE's 50 ms scrape costs a real vLLM replica (~5 ms of its CPU per /metrics page)",
           "2026-12-real-vllm.md#the-cause-of-the-earlier-tail-the-machine-then-our-scrape-interval", tuple(
               _x(f"epp-{prefix}-scrape{ms}", prefix,
                  f"epp-{prefix} scraping every {ms} ms (`--refresh-metrics-interval`; a real vLLM's /metrics page "
                  "costs its API server ~5 ms of CPU)", serve_args=("--refresh-metrics-interval", f"{ms / 1000:g}"))
               for prefix in _PREFIXES for ms in (200, 500))),
    Family("How the approximate index is sized: an LRU that never forgets, GIE's 4 characters a token",
           "2026-12-pickers-and-cost-issue14-round2-s7-s13.md#the-learned-characters-per-token-and-four-pods-that-size-"
           "their-index-alike-issue-14-round-2-session-9", (
               _x("epp-approx-fixed-lru", "approx+fixed-lru",
                  "epp-approx with autoTune: false (its LRU at lruCapacityPerServer, never full here: a tree that "
                  "never forgets)"),
               _x("epp-approx-4cpt", "approx+4cpt",
                  "epp-approx sizing its LRU at GIE's 4 characters a token (charsPerToken: 4; ~1.8x the replicas' "
                  "caches on the simulator's text)"),
           )),
    Family("How far two runs of one configuration differ (the same pipeline twice in one run)",
           "2026-12-cost-and-scale-out-issue14-round1.md#cheaper-per-request-issue-14-after-the-hot-path-work-against-"
           "a-minimal-picker", (
               _x("epp-approx-repeat", "approx",
                  "epp-approx again in the same run: how far two runs of one configuration differ"),
           )),
)

EXPERIMENTS: dict[str, Contender] = {c.name: c for family in FAMILIES for c in family.contenders}


def family_of(name: str) -> Family:
    """The family an experiment belongs to."""
    for family in FAMILIES:
        if any(c.name == name for c in family.contenders):
            return family
    raise KeyError(name)


def known() -> dict[str, Contender]:
    """Every contender a run can name: the comparison's, then the experiments."""
    return {**CONTENDERS, **EXPERIMENTS}


def lookup(name: str) -> Contender:
    """The contender or experiment called `name` (KeyError naming both lists when there is none)."""
    found = CONTENDERS.get(name) or EXPERIMENTS.get(name)
    if found is None:
        raise KeyError(f"unknown contender {name!r}; contenders: {', '.join(CONTENDERS)}; experiments: "
                       f"{', '.join(EXPERIMENTS)} (python -m bench.routing list)")
    return found


__all__ = ["EXPERIMENTS", "FAMILIES", "Family", "family_of", "known", "lookup"]
