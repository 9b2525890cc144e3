"""Rendezvous homes for prompt prefixes that no endpoint holds: pickers agree without talking.

Several pickers of one pool learn each other's prefix routes over the peer link (`epp.peer`), but
only after a delay: a group's first requests that reach two pickers within it would each be
placed by load alone, and two load views that differ by one unseen request pick different
endpoints, so the group's prefix gets computed and cached twice. The home rule removes that race
by construction: when a prefix producer finds no endpoint holding any block of the request, it
names a home computed from the prefix alone, the same in every picker:

- rank every candidate by `xxh64(endpoint name, seed = the chain's first block key)`
  (rendezvous hashing: a prefix's ranking only changes for the endpoints that come or go);
- the home is the best-ranked candidate among the least loaded ones (the fewest waiting
  requests, and KV-cache use at most `KV_SLACK` above the lowest), so the rule only chooses
  among endpoints load balancing rates alike: a request whose prompt is never shared (where
  every request has a home) is placed as by load alone.

Pickers disagree only when their load views differ on which endpoints are least loaded. Their
views agree but for what is in flight between them: both count every pick of the pool (their own
and, over the peer link, their peers'), each against its own latest scrape (a pick the scrape
does not show yet counts as unseen, so two scrapes taken at different moments give the same
estimate). `prefix-cache-scorer` scores the home as a full match while no endpoint matches,
so the first request of a group goes where its followers would, and its followers find it
there (at this picker at once, at its peers after the peer link's delay, and until then by the
same rule). The home is published beside the match info (`PREFIX_HOME`), never inside it: the
match info still says that nothing is cached, for the in-flight bookings and the accounting.

The producers' `rendezvousHome` parameter: `true`, or `false` (the default). It is off even
for pickers with peers: measured with arrivals as the workload draws them, pickers without the
home matched one picker on no-sharing, shared-prefix and multi-turn, while with it their TTFT p90
on unique prompts was 1.18-1.45x one picker's and their shared-prefix hit rate 4-5 points lower:
the full match it scores outvotes queue-scorer's prefill-backlog tie-break on every prompt nobody
holds, and requests that reach two pickers within the peer link's delay are rare
(docs/scale-out.md#agreeing-before-the-link-can-tell;
bench/notes/2026-12-cost-and-pickers-issue14-round2-s4-s6.md, "Several pickers, the load generator's arrivals").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import xxhash

from epp.framework.datakeys import PREFIX_HOME
from epp.framework.load import EndpointLoad
from epp.framework.plugin import CycleState
from epp.framework.types import Endpoint

# Requests waiting above the fewest that still count as least loaded. Zero: a request queued
# behind one more prefill waits for it (with unique prompts that doubled TTFT p90 at 2 as slack).
WAITING_SLACK = 0.0
# KV use scraped by both pickers at different moments; the slack covers what changed in between.
KV_SLACK = 0.1

_U64 = (1 << 64) - 1


def rendezvous_rank(anchor: int, endpoint: str) -> int:
    """The endpoint's rank for a prefix (higher first): xxh64 of its name seeded by the prefix's anchor."""
    return xxhash.xxh64_intdigest(endpoint.encode(), seed=anchor & _U64)


def prefix_home(anchor: int, endpoints: Sequence[Endpoint],
                load_of: Callable[[Endpoint], EndpointLoad]) -> Endpoint | None:
    """The best-ranked endpoint for `anchor` among those within the load bound (None if no endpoints)."""
    if not endpoints:
        return None
    loads = [load_of(ep) for ep in endpoints]
    waiting = [load.waiting_estimate(ep.metrics) for ep, load in zip(endpoints, loads)]
    kv = [load.kv_usage_estimate(ep.metrics) for ep, load in zip(endpoints, loads)]
    waiting_bound = min(waiting) + WAITING_SLACK
    kv_bound = min(kv) + KV_SLACK
    best: Endpoint | None = None
    best_rank = -1
    for ep, w, k in zip(endpoints, waiting, kv):
        if w <= waiting_bound and k <= kv_bound:
            rank = rendezvous_rank(anchor, ep.name)
            if rank > best_rank:
                best, best_rank = ep, rank
    return best


def publish_home(state: CycleState, anchor: int, endpoints: Sequence[Endpoint],
                 load_of: Callable[[Endpoint], EndpointLoad], key: str = PREFIX_HOME) -> str | None:
    """Put the home of a prefix that no endpoint holds into `state` (under `key`, `PREFIX_HOME`); its name."""
    home = prefix_home(anchor, endpoints, load_of)
    if home is None:
        return None
    state.put_endpoint_data(key, home.name, 1.0)
    return home.name
