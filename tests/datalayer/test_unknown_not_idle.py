"""Unknown is not idle (issue #18 item 6): endpoints whose /metrics never answer, or stop answering,
do not draw the traffic that zero queue and zero KV use would attract.

The original input: a pool where some backends' `/metrics` never answered; for ~2.7 s after the
picker reported SERVING every pick went to them, and a backend whose `/metrics` started hanging
kept its share for ~3 s. Here the picker scrapes real loopback servers with the default config.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from epp.datalayer.registry import parse_endpoint_list
from epp.server.runner import EppServer, ServeOptions
from tests.support.extproc import ExtProcClient, headers_of, request_body, request_headers
from tests.support.vllm_metrics import VllmState, vllm_metrics_page
from tests.support.wait import wait_until

BODY = json.dumps({"model": "tiny", "prompt": "hello"}).encode()


async def picks(client: ExtProcClient, count: int) -> Counter:
    seen: Counter = Counter()
    for _ in range(count):
        replies = await client.exchange([request_headers(), request_body(BODY)], expect=2)
        seen[headers_of(replies[0].request_headers.response.header_mutation)["x-gateway-destination-endpoint"]] += 1
    return seen


async def test_never_scraped_and_newly_hanging_endpoints_lose_their_share(metrics_servers):
    busy = vllm_metrics_page(VllmState(waiting=3, running=4, kv_usage=0.5))
    light = vllm_metrics_page(VllmState(waiting=0, running=1, kv_usage=0.1))
    healthy = [await metrics_servers(busy), await metrics_servers(light)]
    silent = [await metrics_servers(busy), await metrics_servers(busy)]
    for server in silent:
        server.delay = 60  # /metrics never answers
    server = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        endpoints=parse_endpoint_list(",".join(s.hostport for s in healthy + silent)),
        scrape_metrics=True, refresh_metrics_interval_s=0.05, grace_period_s=1))
    await server.start()
    client = ExtProcClient(server.grpc_port)
    try:
        assert server.is_ready()
        # As soon as the answering backends have been scraped once, the silent ones get nothing,
        # though their (default) zero load would otherwise make them everyone's first choice.
        await wait_until(lambda: all(server.endpoints.get(s.hostport).metrics.update_time > 0 for s in healthy))
        seen = await picks(client, 30)
        assert not any(seen[s.hostport] for s in silent), seen
        assert seen[healthy[1].hostport] > 0  # the lighter one, as the scorers want

        # The favourite starts hanging: within the freshness window (0.5 s at a 50 ms interval) it is out.
        healthy[1].delay = 60
        await asyncio.sleep(0.8)
        seen = await picks(client, 30)
        assert seen == Counter({healthy[0].hostport: 30}), seen
    finally:
        await client.close()
        await server.stop(0)


async def test_with_no_fresh_metrics_anywhere_every_endpoint_stays_a_candidate(metrics_servers):
    silent = [await metrics_servers(""), await metrics_servers("")]
    for s in silent:
        s.delay = 60
    server = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        endpoints=parse_endpoint_list(",".join(s.hostport for s in silent)),
        scrape_metrics=True, refresh_metrics_interval_s=0.05, grace_period_s=1))
    await server.start()
    client = ExtProcClient(server.grpc_port)
    try:
        seen = await picks(client, 5)
        assert sum(seen.values()) == 5 and set(seen) <= {s.hostport for s in silent}
    finally:
        await client.close()
        await server.stop(0)
