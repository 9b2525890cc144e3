"""agent-identity: the session of a request from each agent header and body field, precedence, parent links, bounds."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from prometheus_client import CollectorRegistry

from epp.framework import SESSION, ConfigError, CycleState, PluginContext, SessionKey
from epp.request.parsing import RequestParser
from epp.scorers.sessions import AgentIdentity, bounded_session_id
from epp.server.transport import header_map
from tests.support.scheduling import DirectorHarness, endpoint, make_plugin


def parse(headers: dict[str, str], body: dict, path: str = "/v1/chat/completions"):
    """A request as the picker's parser makes it (body_session filled from the body)."""
    raw = json.dumps({"model": "m", **body}).encode()
    request, _ = RequestParser().parse(request_id="r", headers={":path": path, **headers}, body=raw, subset_hint=None)
    return request


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def identity(params: dict | None = None, registry: CollectorRegistry | None = None) -> AgentIdentity:
    plugin = make_plugin("agent-identity", params, context=PluginContext(metrics_registry=registry))
    assert isinstance(plugin, AgentIdentity)
    return plugin


def run(plugin: AgentIdentity, request):
    state = CycleState()
    out = plugin.preprocess(state, request)
    return out, state.get(SESSION)


@pytest.mark.parametrize("header", ["x-claude-code-session-id", "x-session-affinity", "session-id", "session_id",
                                    "x-session-id"])
def test_each_agent_header_names_the_session_and_the_fairness_id(header):
    out, key = run(identity(), parse({header: "abc-123"}, CHAT))
    assert key == SessionKey("abc-123", None, header)
    assert out.fairness_id == "abc-123"


@pytest.mark.parametrize("body, path, source_value", [
    ({**CHAT, "prompt_cache_key": "conv-7", "user": "alice"}, "/v1/chat/completions", "conv-7"),
    ({**CHAT, "user": "alice"}, "/v1/chat/completions", "alice"),
    ({"input": "hi", "prompt_cache_key": "resp-1"}, "/v1/responses", "resp-1"),
    ({"max_tokens": 8, **CHAT, "metadata": {"user_id": "user_9_session_4"}}, "/v1/messages", "user_9_session_4"),
])
def test_the_body_names_the_session_when_no_header_does(body, path, source_value):
    out, key = run(identity(), parse({}, body, path))
    assert key == SessionKey(source_value, None, "body")
    assert out.fairness_id == source_value


def test_llm_d_order_then_ours_first_match_wins():
    headers = {"x-session-id": "generic", "session-id": "codex", "x-session-affinity": "opencode",
               "x-claude-code-session-id": "claude"}
    plugin = identity()
    assert run(plugin, parse(headers, {**CHAT, "user": "u"}))[1].session == "claude"
    del headers["x-claude-code-session-id"]
    assert run(plugin, parse(headers, CHAT))[1].session == "opencode"
    del headers["x-session-affinity"]
    assert run(plugin, parse(headers, CHAT))[1].session == "codex"
    del headers["session-id"]
    assert run(plugin, parse(headers, {**CHAT, "user": "u"}))[1].session == "generic"
    # additionalSessionHeaders go first (llm-d), lower-cased.
    custom = identity({"additionalSessionHeaders": ["X-My-Agent"]})
    assert run(custom, parse({"x-my-agent": "mine", "x-session-id": "generic"}, CHAT))[1] == \
        SessionKey("mine", None, "x-my-agent")


def test_no_session_leaves_the_request_alone_and_body_reading_can_be_off():
    plugin = identity({"bodySession": False})
    request = parse({}, {**CHAT, "user": "alice"})
    out, key = run(plugin, request)
    assert key is None and out is request and out.fairness_id == "default-flow"


def test_the_clients_own_fairness_id_wins_but_the_session_is_still_published():
    out, key = run(identity(), parse({"x-llm-d-inference-fairness-id": "tenant-a", "session-id": "s1"}, CHAT))
    assert out.fairness_id == "tenant-a" and key.session == "s1"


def test_a_sub_agent_joins_its_parents_program_and_stays_linked():
    plugin = identity({"parentSessionHeader": "X-Parent"})
    out, key = run(plugin, parse({"x-session-id": "child", "x-parent": "root"}, CHAT))
    assert key == SessionKey("child", "root", "x-session-id") and out.fairness_id == "root"
    # A grandchild names only its direct parent: it lands in the root's program too.
    out, key = run(plugin, parse({"x-session-id": "grandchild", "x-parent": "child"}, CHAT))
    assert key.parent == "child" and out.fairness_id == "root"
    # A later turn of the child without the header is still in the root's program.
    out, key = run(plugin, parse({"x-session-id": "child"}, CHAT))
    assert key == SessionKey("child", "root", "x-session-id") and out.fairness_id == "root"


def test_an_over_long_session_id_is_replaced_by_its_digest_and_keeps_its_session():
    long_id = "s" * 10_000
    plugin = identity()
    first = run(plugin, parse({"x-session-id": long_id}, CHAT))[1]
    second = run(plugin, parse({"x-session-id": long_id}, CHAT))[1]
    other = run(plugin, parse({"x-session-id": long_id + "x"}, CHAT))[1]
    assert first.session == second.session == bounded_session_id(long_id, 256)
    assert first.session.startswith("sha256:") and len(first.session) == len("sha256:") + 32
    assert other.session != first.session


def test_a_non_utf8_or_control_character_value_is_not_a_session_the_next_source_is_read():
    # Envoy hands the header's raw bytes; the transport decodes them with replacement characters.
    headers = header_map(base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key="x-claude-code-session-id", raw_value=b"\xff\xfe-bad"),
        base_pb2.HeaderValue(key="x-session-id", raw_value=b"good-one")]))
    registry = CollectorRegistry()
    plugin = identity(registry=registry)
    assert run(plugin, parse(headers, CHAT))[1].session == "good-one"
    assert run(plugin, parse({"session-id": "bell\x07here"}, {**CHAT, "user": "x"}))[1] == SessionKey("x", None, "body")
    rejected = registry.get_sample_value("epp_session_identity_rejected_total",
                                         {"plugin": "agent-identity", "reason": "invalid"})
    assert rejected >= 2


def test_a_flood_of_distinct_sub_agents_is_bounded_by_the_link_table():
    registry = CollectorRegistry()
    plugin = identity({"maxSessions": 1000, "parentSessionHeader": "x-parent"}, registry)
    for i in range(20_000):
        run(plugin, parse({"x-session-id": f"child-{i}", "x-parent": f"root-{i % 7}"}, CHAT))
    assert len(plugin.links) == 1000
    labels = {"table": "agent-identity"}
    assert registry.get_sample_value("epp_session_table_entries", labels) == 1000
    assert registry.get_sample_value("epp_session_table_evictions_total", {**labels, "reason": "capacity"}) == 19_000


def test_parameters_are_checked():
    with pytest.raises(ConfigError, match="additionalSessionHeaders"):
        identity({"additionalSessionHeaders": ["ok", ""]})
    with pytest.raises(ConfigError, match="maxSessionIdLength"):
        identity({"maxSessionIdLength": 4})


async def test_the_director_sets_the_fairness_id_before_flow_control_queues_the_request():
    harness = DirectorHarness("""
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: agent-identity
- type: queue-scorer
- type: concurrency-detector
  parameters: {maxConcurrency: 1}
flowControl:
  saturationDetector: {pluginRef: concurrency-detector}
  defaultPriorityBand: {fairnessPolicyRef: program-aware-fairness}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
""")
    harness.set_pool([endpoint(0)])
    controller = harness.loaded.flow_controller
    assert controller is not None
    seen: list[str] = []
    fairness = controller.config.default_band.fairness
    original = fairness.on_enqueue
    fairness.on_enqueue = lambda item, now: (seen.append(item.fairness_id), original(item, now))  # type: ignore[method-assign]
    _, state = await harness.pick(parse({"x-claude-code-session-id": "agent-1"}, CHAT))
    assert seen == ["agent-1"] and state.get(SESSION).session == "agent-1"
