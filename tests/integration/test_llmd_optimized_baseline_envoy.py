"""llm-d's optimized-baseline pipeline (our config of the guide) through real Envoy, the real picker and
simulated vLLM replicas: a conversation's turns stick to the replica that holds its prefix, and a
stream's prompt tokens leave the in-flight counters at its first token while the request stays
counted until the stream ends."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.routing.contenders import LLMD_CONFIGS
from epp.datalayer.registry import parse_endpoint_list
from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from epp.envoy import EnvoyProcess, render_config
from tests.support.pods import start_picker
from tests.support.ports import free_port
from tests.support.precise import prompt_of

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(120)]

MODEL = "sim-model"
# The benchmark's copy of the guide's pipeline is the one source (the benchmark must not depend on tests/).
BASELINE = LLMD_CONFIGS / "llmd-optimized-baseline.yaml"


async def served(http: aiohttp.ClientSession, endpoint: str) -> float:
    async with http.get(f"http://{endpoint}/metrics") as resp:
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_success_total")


async def completion(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 2) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def test_turns_stick_and_prompt_tokens_leave_at_the_first_chunk():
    tokenizer_dir = default_tokenizer_dir()
    # fast*20: 10 ms per decode step, so a 60-token answer streams for over half a second.
    config = FleetConfig(replicas=3, model=MODEL, tokenizer_dir=tokenizer_dir, profile="fast*20",
                         num_gpu_blocks=2048, block_size=16, kv_events=False)
    epp = envoy = None
    async with SimFleet(config) as fleet, aiohttp.ClientSession() as http:
        try:
            epp = await start_picker(BASELINE.read_text(), parse_endpoint_list(",".join(fleet.endpoints)))
            listen, admin = free_port(), free_port()
            envoy = EnvoyProcess(render_config(listen_port=listen, admin_port=admin, epp_port=epp.grpc_port), admin)
            await envoy.start()
            url = f"http://127.0.0.1:{listen}/v1/completions"
            producer = epp.pipeline.plugin("inflight-load-producer")
            history = prompt_of(tokenizer_dir, seed=7, tokens=1500)

            before = [await served(http, e) for e in fleet.endpoints]
            await completion(http, url, history + " Turn 1.")
            for turn in range(2, 6):  # two at a time: the holder is busier than the others, and keeps them
                await asyncio.gather(completion(http, url, history + f" Turn {turn}a."),
                                     completion(http, url, history + f" Turn {turn}b."))
            after = [await served(http, e) for e in fleet.endpoints]
            per_replica = [int(a - b) for a, b in zip(after, before)]
            assert sorted(per_replica) == [0, 0, 9], per_replica
            home = fleet.endpoints[per_replica.index(9)]
            assert (producer.tracker.requests(home), producer.tracker.tokens(home)) == (0, 0)

            # A long answer: after its first chunk its prompt tokens are released, the request is not.
            body = {"model": MODEL, "prompt": history + " Turn 6.", "max_tokens": 60, "stream": True,
                    "ignore_eos": True}
            async with http.post(url, json=body) as resp:
                assert resp.status == 200
                first = await resp.content.readline()
                while not first.startswith(b"data: {"):
                    first = await resp.content.readline()
                assert json.loads(first[len(b"data: "):])["choices"]
                await asyncio.sleep(0.05)  # the picker sees the chunk as Envoy forwards it
                during = (producer.tracker.requests(home), producer.tracker.tokens(home))
                await resp.read()
            assert during == (1, 0)
            assert (producer.tracker.requests(home), producer.tracker.tokens(home)) == (0, 0)
        finally:
            if envoy is not None:
                await envoy.stop()
            if epp is not None:
                await epp.stop(0)
