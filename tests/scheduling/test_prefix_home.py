"""prefix-home-scorer: one stable home per prompt prefix, spread across endpoints, moved only when it leaves."""

from collections import Counter

from epp.framework import PluginParams
from epp.framework.plugin import CycleState, PluginContext
from epp.framework.types import Endpoint, InferenceRequest
from epp.scorers.prefix_home import PrefixHomeScorer
from tests.support.requests import format_of

ENDPOINTS = [Endpoint(f"10.0.0.{i}", 8000) for i in range(1, 9)]


def chat(system: str, question: str, salt: str | None = None) -> InferenceRequest:
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return InferenceRequest("id", "chat/completions", "m", "m", body, cache_salt=salt, format=format_of("chat/completions"))


def home(scorer, request, endpoints=ENDPOINTS) -> str:
    scores = scorer.score(CycleState(), request, endpoints)
    assert list(scores.values()) == [1.0]
    return next(iter(scores))


def make(prefix_bytes: int = 256) -> PrefixHomeScorer:
    return PrefixHomeScorer("home", PluginParams("home", {"prefixBytes": prefix_bytes}), PluginContext())


def test_requests_sharing_a_system_prompt_share_a_home():
    scorer = make()
    system = "You are a support agent for ACME. " * 20
    assert len({home(scorer, chat(system, f"question {i}")) for i in range(20)}) == 1


def test_different_prefixes_spread_over_the_endpoints():
    scorer = make()
    homes = Counter(home(scorer, chat(f"tenant {t} system prompt " * 20, "q")) for t in range(400))
    assert len(homes) == len(ENDPOINTS)
    assert max(homes.values()) < 2 * 400 / len(ENDPOINTS)


def test_a_home_moves_only_when_its_endpoint_leaves():
    scorer = make()
    requests = [chat(f"tenant {t} " * 40, "q") for t in range(100)]
    before = [home(scorer, r) for r in requests]
    leaving = ENDPOINTS[3].name
    after = [home(scorer, r, [ep for ep in ENDPOINTS if ep.name != leaving]) for r in requests]
    for b, a in zip(before, after):
        assert a == b or b == leaving


def test_cache_salt_gives_another_home_distribution():
    scorer = make()
    requests = [chat(f"tenant {t} " * 40, "q") for t in range(64)]
    plain = [home(scorer, r) for r in requests]
    salted = [home(scorer, chat(f"tenant {t} " * 40, "q", salt="s1")) for t in range(64)]
    assert plain != salted
