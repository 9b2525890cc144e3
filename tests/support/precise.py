"""Shared pieces of the precise-routing tests: prompts, the real picker, routing calls, index views."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from tokenizers import Tokenizer

from epp.datalayer.registry import EndpointSpec
from epp.framework.types import InferenceRequest
from epp.kvevents.decoding import Tier
from epp.kvevents.producer import PrecisePrefixCacheProducer
from epp.server.runner import EppServer
from tests.support.extproc import ExtProcClient, route
from tests.support.pods import start_picker
from tests.support.requests import format_of

VOCABULARY = ("the a of to and in is it you that was for on are with as they be at one have this from or had by "
              "word but what some we can out other were all there when use your how said each which do their time "
              "will way about many then them write would like so these long make thing see two has look more day "
              "system prompt user question answer model cache block token request route replica server query table "
              "select where group order limit join database schema customer invoice product")
WORDS = VOCABULARY.split()


def prompt_of(tokenizer_dir: str | Path, seed: int, tokens: int) -> str:
    """A text of random words from the tiny model's vocabulary with at least `tokens` tokens."""
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    rng = random.Random(seed)
    words = [f"Document {seed}:"]
    while True:
        words.extend(rng.choice(WORDS) for _ in range(32))
        text = " ".join(words)
        if len(tok.encode(text).ids) >= tokens:
            return text


def completion_body(model: str, prompt: str, max_tokens: int = 1) -> bytes:
    """A `/v1/completions` JSON body."""
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()


class Picker:
    """A started picker and a gRPC client of its ext_proc API."""

    def __init__(self, server: EppServer) -> None:
        self.server = server
        self.client = ExtProcClient(server.grpc_port)

    @classmethod
    async def start(cls, config_text: str, endpoints: Sequence[EndpointSpec]) -> Picker:
        return cls(await start_picker(config_text, endpoints))

    async def stop(self) -> None:
        await self.client.close()
        await self.server.stop(0)

    async def route(self, model: str, prompt: str) -> str:
        """The `ip:port` the picker routes this completion request to (header and metadata agree)."""
        header, metadata, _ = await route(self.client, completion_body(model, prompt))
        assert header == metadata
        return header

    @property
    def producer(self) -> PrecisePrefixCacheProducer:
        assert self.server.director is not None
        [producer] = self.server.director.pipeline.plugins_of(PrecisePrefixCacheProducer)
        return producer

    async def held_tiers(self, model: str, prompt: str, endpoints: Sequence[str]) -> dict[str, list[Tier]]:
        """Per endpoint, the best tier of each leading block of this prompt that the picker's index holds."""
        producer = self.producer
        request = InferenceRequest("probe", "completions", model, model, {"prompt": prompt}, format=format_of("completions"))
        tokens = await producer.prompt_tokens(request)
        assert tokens is not None
        keys = producer.index.keyer.request_keys(tokens, model, None)
        found = producer.index.lookup(keys, list(endpoints))
        return {ep: list(found.get(ep, ())) for ep in endpoints}

    async def held_blocks(self, model: str, prompt: str, endpoints: Sequence[str]) -> dict[str, int]:
        """Per endpoint, how many leading blocks of this prompt the picker's index says it holds."""
        return {ep: len(tiers) for ep, tiers in (await self.held_tiers(model, prompt, endpoints)).items()}

    def metrics_fresh(self, within_s: float = 0.25) -> bool:
        """Whether every endpoint was scraped lately: the picker leaves out those it has not heard from."""
        return all(ep.metrics.age() <= within_s for ep in self.server.endpoints.snapshot())

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample of the picker's own Prometheus registry (0 when absent)."""
        value = self.server.metrics.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


def fleet_specs(info: Sequence[dict]) -> list[EndpointSpec]:
    """Endpoint specs of simulated replicas, with their KV-event and replay ports as labels."""
    specs = []
    for replica in info:
        host, port = replica["endpoint"].rsplit(":", 1)
        events_port = replica["kv_events_endpoint"].rsplit(":", 1)[1]
        replay_port = replica["kv_replay_endpoint"].rsplit(":", 1)[1]
        specs.append(EndpointSpec(host, int(port), {"kv-events-port": events_port, "kv-replay-port": replay_port}))
    return specs


async def post_completion(session: aiohttp.ClientSession, endpoint: str, model: str, prompt: str,
                          max_tokens: int = 1) -> dict:
    """POST one completion straight to a replica (bypassing the picker); returns its usage."""
    async with session.post(f"http://{endpoint}/v1/completions", data=completion_body(model, prompt, max_tokens),
                            headers={"Content-Type": "application/json"}) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["usage"]
