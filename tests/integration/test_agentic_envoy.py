"""The agentic sample config (examples/configs/agentic.yaml) through real Envoy, the real picker and simulated replicas.

Agent sessions send growing chat turns (each turn's prompt is the previous one plus the reply
and a tool result) with their agents' session headers; a sub-agent names its parent. Each
session's turns stay on the replica holding its context (the replica named in each response's
`x-sim-replica`), agent-identity reads every header, and the session table and decisions show in
the picker's metrics.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from epp.datalayer.registry import parse_endpoint_list
from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.engine.sim.server import REPLICA_HEADER
from epp.envoy import EnvoyProcess, render_config
from tests.support.extproc import metric_samples
from tests.support.pods import start_picker
from tests.support.ports import free_port
from tests.support.precise import prompt_of
from tests.support.wait import wait_until

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(120)]

MODEL = "sim-model"
CONFIG = (Path(__file__).parents[2] / "examples" / "configs" / "agentic.yaml").read_text()
SESSIONS = {"claude": "x-claude-code-session-id", "opencode": "x-session-affinity", "codex": "session-id"}
TURNS = 4


async def agent_session(http: aiohttp.ClientSession, url: str, name: str, headers: dict[str, str],
                        system: str, seed: int) -> list[str]:
    """One agent session: TURNS turns, each the previous prompt plus the reply and a tool result."""
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": prompt_of(default_tokenizer_dir(), seed, 200)}]
    replicas = []
    for turn in range(TURNS):
        body = {"model": MODEL, "messages": messages, "max_tokens": 8}
        async with http.post(url, json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
            replicas.append(resp.headers[REPLICA_HEADER])
        messages = [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"tool result {turn} of {name}: "
                     + prompt_of(default_tokenizer_dir(), seed * 10 + turn, 100)}]
        await asyncio.sleep(0.05)  # the tool runs
    return replicas


async def test_agent_sessions_stay_on_the_replica_holding_their_context():
    tokenizer_dir = default_tokenizer_dir()
    fleet_config = FleetConfig(replicas=3, model=MODEL, tokenizer_dir=tokenizer_dir, profile="fast",
                               num_gpu_blocks=2048, block_size=16, cpu_blocks=2048, kv_events=False)
    epp = envoy = None
    async with SimFleet(fleet_config) as fleet, aiohttp.ClientSession() as http:
        try:
            epp = await start_picker(CONFIG, parse_endpoint_list(",".join(fleet.endpoints)))
            await wait_until(lambda: all(ep.metrics.update_time > 0 for ep in epp.endpoints.snapshot()),
                             "the first scrape of every replica", 20)
            listen, admin = free_port(), free_port()
            envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port), admin)
            await envoy.start()
            url = f"http://127.0.0.1:{listen}/v1/chat/completions"
            system = "You are a coding agent. Tools: read, edit, run. " * 40  # the agents' shared prefix
            runs = [agent_session(http, url, name, {header: f"{name}-session"}, system, seed)
                    for seed, (name, header) in enumerate(SESSIONS.items(), start=1)]
            # A sub-agent of the Claude Code session, on the same prefix.
            runs.append(agent_session(http, url, "sub", {"x-claude-code-session-id": "sub-agent-1",
                                                         "x-parent-session-id": "claude-session"}, system, 9))
            placements = await asyncio.wait_for(asyncio.gather(*runs), 90)
            samples = metric_samples(epp.metrics_port)
        finally:
            if envoy is not None:
                await envoy.stop()
            if epp is not None:
                await epp.stop(0)
    for replicas in placements:
        assert len(set(replicas)) == 1, f"a session moved on an idle fleet: {placements}"
    for name, header in SESSIONS.items():
        key = f'epp_session_identity_requests_total{{plugin="agent-identity",source="{header}"}}'
        expected = TURNS * (2 if name == "claude" else 1)  # the sub-agent sends Claude Code's header too
        assert samples[key] == expected
    decisions = {d: samples.get(f'epp_session_routing_decisions_total{{decision="{d}",'
                                f'plugin="session-affinity-cost-scorer"}}', 0.0) for d in ("new", "stay", "move")}
    assert decisions == {"new": 4.0, "stay": 4.0 * (TURNS - 1), "move": 0.0}
    assert samples['epp_session_table_entries{table="session-affinity-cost-scorer"}'] == 4
    assert samples['epp_session_table_entries{table="agent-identity"}'] == 1  # the sub-agent's link
