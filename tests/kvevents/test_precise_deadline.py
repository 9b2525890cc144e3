"""A turn whose data producers run out of time still pays for the next one: its tokens and block keys are cached.

Through Envoy, a cold 100k-token prompt takes longer to tokenize than the producers' 400 ms; the
request routes on without prefix data, but the conversation's next turn must find this turn's
tokens and keys (before, the work was dropped with the request and every later turn missed too).
"""

from __future__ import annotations

import asyncio
import threading
from array import array

import pytest
from prometheus_client import CollectorRegistry

from epp.engine.tinymodel import write_tiny_model
from epp.framework import PluginRegistry
from epp.framework.plugin import CycleState, PluginContext
from epp.framework.types import Endpoint, InferenceRequest
from epp.kvevents import producer as precise_prefix
from tests.support.precise import prompt_of
from tests.support.requests import format_of

A = Endpoint("10.0.0.1", 8000)


def producer(tmp_path, registry: CollectorRegistry):
    reg = PluginRegistry()
    precise_prefix.register(reg)
    model_dir = write_tiny_model(tmp_path / "tiny", weights=False)
    params = {"blockSizeTokens": 4, "subscribe": False, "tokenizers": {"tiny": str(model_dir)},
              "offloadTokenizationChars": 0}
    return reg.build("precise-prefix-cache-producer", "p", params, PluginContext(metrics_registry=registry)), model_dir


def turn(text: str) -> InferenceRequest:
    return InferenceRequest("r", "completions", "tiny", "tiny", {"prompt": text}, format=format_of("completions"))


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


@pytest.mark.asyncio
async def test_a_turn_out_of_time_leaves_its_tokens_and_keys_for_the_next_turn(tmp_path):
    registry = CollectorRegistry()
    prod, model_dir = producer(tmp_path, registry)
    await prod.start()
    try:
        history = prompt_of(model_dir, 1, 600)
        # Both tokenizer threads busy: this turn's work waits in the pool's queue past its deadline.
        busy = threading.Event()
        for _ in range(2):
            prod.tokenizers._executor.submit(busy.wait, 10)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await prod.prepare(CycleState(), turn(history), [A])
        busy.set()
        # The work goes on without the request: the turn's tokens and keys land in their caches.
        for _ in range(200):
            if len(prod.key_cache.store) == 1:
                break
            await asyncio.sleep(0.01)
        assert len(prod.key_cache.store) == 1
        assert sample(registry, "epp_tokenization_cache_lookups_total", outcome="miss") == 1

        nxt = history + " the answer and a tool result" * 20
        state = CycleState()
        await prod.prepare(state, turn(nxt), [A])
        # The next turn reused both: a prefix hit in the tokens, a hit in the keys.
        assert sample(registry, "epp_tokenization_cache_lookups_total", outcome="prefix_hit") == 1
        assert sample(registry, "epp_kv_key_cache_lookups_total", outcome="hit") == 1
        # ... with exactly the keys of a full tokenization and keying.
        tok = prod.tokenizers.load("tiny")
        full = tok.special_prefix + array("I", tok.tokenizer.encode(nxt, add_special_tokens=False).ids)
        picked = state.get("p")
        assert list(picked.keys) == prod.index.keyer.request_keys(full, "tiny")
    finally:
        await prod.stop()
