"""`epp explain` runs the director's own stages: its plugin calls are the director's, less the side effects.

Every plugin of the pipeline is watched (each call appends `(method, plugin name)` to one list); the
same request is explained, then routed for real. Explain first: it changes nothing, so the real
request sees the same state and makes the same decisions (the P/D handler's second round included).
"""

from __future__ import annotations

import functools
import json

import pytest

from epp.debug.explain import ExplainInput, explain
from epp.framework import Admitter, CapacityGate, DataProducer, ErrorCode, InferenceError, PluginRegistry
from epp.framework.datakeys import PREFIX_MATCH_INFO
from epp.request.parsing import RequestParser
from epp.requestcontrol.director import STAGES
from tests.support.configs import endpoint_picker_config, pd_config, plugin
from tests.support.scheduling import DirectorHarness, endpoint, request

# What each kind of plugin is called through; capacity gates and pre-request hooks have side effects.
WATCHED = ("preprocess", "ensure_capacity", "admit", "prepare", "pick_profiles", "filter", "score", "pick", "process_results",
           "pre_request")
SIDE_EFFECTS = {"ensure_capacity", "pre_request"}


class OpenAdmitter(Admitter):
    """Reads no producer data: runs before the producers."""

    type_name = "open-admitter"

    def admit(self, state, request, endpoints):
        return None


class PrefixReadingAdmitter(Admitter):
    """Reads the prefix producer's data: runs after the producers."""

    type_name = "prefix-reading-admitter"

    def consumes(self):
        return frozenset({PREFIX_MATCH_INFO})

    def admit(self, state, request, endpoints):
        assert all(state.endpoint_data(PREFIX_MATCH_INFO, ep.name) is not None for ep in endpoints)


class CountingProducer(DataProducer):
    """A second producer: the director runs producers in the loader's order."""

    type_name = "counting-producer"

    async def prepare(self, state, request, endpoints):
        return None


class PassGate(CapacityGate):
    """A capacity gate that keeps every candidate (a real one may wake a sleeping replica)."""

    type_name = "pass-gate"

    async def ensure_capacity(self, state, request, candidates):
        return candidates


def registry() -> PluginRegistry:
    """The built-in plugin types and this module's (a registry of its own: the built-in one is shared)."""
    plugins = PluginRegistry()
    plugins.load_entry_points()
    for cls in (OpenAdmitter, PrefixReadingAdmitter, CountingProducer, PassGate):
        plugins.register_class(cls)
    return plugins


EXTRAS = ["open-admitter", "prefix-reading-admitter", "counting-producer", "pass-gate"]
ROLE = "llm-d.ai/role"
CONFIGS = {
    "admitters and producers": endpoint_picker_config(
        [*EXTRAS, "agent-identity", plugin("approx-prefix-cache-producer", autoTune=False), "inflight-load-producer",
         "prefix-cache-scorer", "queue-scorer", "active-request-scorer", "max-score-picker"],
        {"prefix-cache-scorer": 3, "queue-scorer": 1, "active-request-scorer": 1, "max-score-picker": None}),
    "P/D": pd_config(64, *({"type": t} for t in EXTRAS)),
}
POOLS = {
    "admitters and producers": [endpoint(0, queue=2), endpoint(1), endpoint(2, queue=5)],
    "P/D": [endpoint(0, labels={ROLE: "prefill"}), endpoint(1, labels={ROLE: "prefill"}),
            endpoint(2, labels={ROLE: "decode"}), endpoint(3, labels={ROLE: "decode"}, queue=1)],
}


def watch(harness: DirectorHarness, calls: list[tuple[str, str]]) -> None:
    """Every watched method of every plugin instance appends `(method, plugin name)` to `calls` when called."""
    for entry in harness.loaded.plugins:
        instance = entry.plugin
        for method in WATCHED:
            original = getattr(instance, method, None)
            if original is None:
                continue

            if method == "prepare" or method == "ensure_capacity":
                @functools.wraps(original)
                async def watched(*args, _original=original, _method=method, _name=instance.name, **kw):
                    calls.append((_method, _name))
                    return await _original(*args, **kw)
            else:
                @functools.wraps(original)
                def watched(*args, _original=original, _method=method, _name=instance.name, **kw):
                    calls.append((_method, _name))
                    return _original(*args, **kw)
            setattr(instance, method, watched)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("prompt", ["short", "a long prompt that fills many blocks " * 40])
async def test_explain_calls_the_directors_plugins_in_its_order_less_the_side_effects(config, prompt):
    harness = DirectorHarness(CONFIGS[config], plugins=registry())
    harness.set_pool(POOLS[config])
    calls: list[tuple[str, str]] = []
    watch(harness, calls)
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    answer = await explain(harness.director, RequestParser(), ExplainInput("/v1/completions", {}, body))
    explained, calls[:] = list(calls), []
    result, _ = await harness.pick(request(prompt, model="m"))
    routed = list(calls)
    assert answer["error"] is None and answer["picked"] == [ep.name for ep in result.targets]
    # Both kinds of stage plugin ran, and the director called the side-effect ones too.
    assert {"ensure_capacity", "admit", "prepare", "pre_request"} <= {method for method, _ in routed}
    assert explained == [call for call in routed if call[0] not in SIDE_EFFECTS]
    # The answer's stage list is the director's, in order, and names what each stage ran or why it did not.
    stages = answer["stages"]
    assert [s["stage"] for s in stages] == [stage.name for stage in STAGES]
    assert {s["stage"]: s.get("skipped") for s in stages} == {
        stage.name: f"side effects: {stage.side_effects}" if stage.side_effects else None for stage in STAGES}
    by_stage = {s["stage"]: s["plugins"] for s in stages}
    # Admitters before data, producers, admitters after data: exactly the order the director called them.
    stage_calls = [name for method, name in routed if method in ("admit", "prepare")]
    assert by_stage["admitters-before-data"] + by_stage["data-producers"] + by_stage["admitters-after-data"] == \
        stage_calls
    # The loader adds the saturation admitter (it reads no data) to the configured one.
    assert by_stage["admitters-before-data"] == ["open-admitter", "saturation-admitter"]
    assert by_stage["admitters-after-data"] == ["prefix-reading-admitter"]
    assert by_stage["capacity-gates"] == ["pass-gate"]
    assert by_stage["pre-request-hooks"] == [name for method, name in routed if method == "pre_request"]
    assert [a["name"] for a in answer["admitters"]] == [*by_stage["admitters-before-data"], "prefix-reading-admitter"]
    assert [p["name"] for p in answer["producers"]] == by_stage["data-producers"]
    assert [note.split(":")[0] for note in answer["notes"]] == ["capacity-gates", "pre-request-hooks", "booking"]


async def test_the_pd_handler_runs_its_prefill_round_in_explain_as_in_the_director():
    harness = DirectorHarness(CONFIGS["P/D"], plugins=registry())
    harness.set_pool(POOLS["P/D"])
    calls: list[tuple[str, str]] = []
    watch(harness, calls)
    prompt = "a long prompt that fills many blocks " * 40
    answer = await explain(harness.director, RequestParser(), ExplainInput(
        "/v1/completions", {}, json.dumps({"model": "m", "prompt": prompt}).encode()))
    assert {p["name"]: p["ran"] for p in answer["profiles"]} == {"prefill": True, "decode": True}
    assert [name for method, name in calls if method == "pick_profiles"] == ["pd-profile-handler"] * 3


class RefusingAdmitter(Admitter):
    type_name = "refusing-admitter"

    def admit(self, state, request, endpoints):
        raise InferenceError(ErrorCode.RESOURCE_EXHAUSTED, "full")


async def test_a_refusal_before_data_stops_the_director_before_the_producers_but_not_explain():
    plugins = registry()
    plugins.register_class(RefusingAdmitter)
    harness = DirectorHarness(endpoint_picker_config(
        ["refusing-admitter", "counting-producer", "queue-scorer", "max-score-picker"],
        ["queue-scorer", "max-score-picker"]), plugins=plugins)
    harness.set_pool(POOLS["admitters and producers"])
    calls: list[tuple[str, str]] = []
    watch(harness, calls)
    answer = await explain(harness.director, RequestParser(), ExplainInput(
        "/v1/completions", {}, b'{"model": "m", "prompt": "x"}'))
    assert answer["error"] == "inference error: ResourceExhausted - full" and answer["picked"]
    explained, calls[:] = list(calls), []
    with pytest.raises(InferenceError):
        await harness.pick(request("x", model="m"))
    # The director stopped at the refusal; explain went on to show where the request would have gone.
    assert calls == [("admit", "refusing-admitter")]
    assert explained[:3] == [("admit", "refusing-admitter"), ("admit", "saturation-admitter"),
                             ("prepare", "counting-producer")]


async def test_explain_says_which_stages_it_skipped_with_flow_control_on():
    harness = DirectorHarness(endpoint_picker_config(["queue-scorer", "max-score-picker"],
                                                     ["queue-scorer", "max-score-picker"],
                                                     featureGates=["flowControl"]))
    harness.set_pool(POOLS["admitters and producers"])
    answer = await explain(harness.director, RequestParser(), ExplainInput(
        "/v1/completions", {}, b'{"model": "m", "prompt": "x"}'))
    assert answer["stages"][:2] == [{"stage": "preprocessors", "plugins": []},
                                    {"stage": "flow-control", "plugins": [],
                                     "skipped": "side effects: queues the request while the pool is saturated"}]
    assert answer["notes"][0] == "flow-control: not run (queues the request while the pool is saturated)"
    assert answer["picked"] == ["192.168.1.2:8000"]


async def test_stages_after_a_failure_are_named_not_reached():
    harness = DirectorHarness(endpoint_picker_config(["queue-scorer", "max-score-picker"],
                                                     ["queue-scorer", "max-score-picker"]))
    harness.set_pool([endpoint(0)])
    answer = await explain(harness.director, RequestParser(), ExplainInput(
        "/v1/completions", {}, b'{"model": "m", "prompt": "x"}', subset_hint=("10.9.9.9:1",)))
    skipped = {s["stage"]: s.get("skipped") for s in answer["stages"]}
    assert skipped["admitters-before-data"] is None  # it ran, and found no candidate
    assert skipped["data-producers"] == skipped["scheduler"] == "not reached"
