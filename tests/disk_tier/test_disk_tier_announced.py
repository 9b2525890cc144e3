"""A disk tier the launcher plans announces its removals by default, and the picker hears them.

Reproduces issue #18 item 9: `epp engine serve` used to plan the disk-manager sidecar without an
events endpoint unless `--disk-manager-events-port` was given, so the picker kept routing to disk
blocks the manager had deleted. Here the plan is built with no such option; the sidecar runs as
the plan says (its own process), and a picker-side subscriber labelled as the plan says sees the
disk copies go.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import pytest
from disk_tier_files import block_hash_int, write_block
from prometheus_client import CollectorRegistry

from epp.datalayer.registry import EndpointRegistry, EndpointSpec
from epp.engine.kv_publisher import BlockStored, KVEventPublisher
from epp.engine.vllm.launcher import HostResources, LaunchOptions, build_plan
from epp.kvevents.decoding import Tier
from epp.kvevents.index import KVBlockIndex
from epp.kvevents.metrics import KVIndexMetrics, KVSubscriberMetrics
from epp.kvevents.subscriber import KVEventSubscriber, SubscriberConfig
from epp.netutil import free_ports
from tests.support.ports import consecutive_free_ports
from tests.support.wait import wait_until

KB = 1024
GPU_HOST = HostResources(mem_available_bytes=64 << 30, disk_free_bytes=lambda p: 1 << 40, platform="gpu")
BLOCK = 16


def tokens_of(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(BLOCK)]


async def until_ready(session: aiohttp.ClientSession, url: str, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.1)):
        try:
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never ready")


def test_a_planned_disk_tier_publishes_removals_without_any_option(tmp_path):
    plan = build_plan(LaunchOptions(model="/m", served_model_name="m", pod_ip="10.0.0.7", cpu_offload_bytes=1 << 30,
                                    disk_path=str(tmp_path), disk_bytes=1 << 30), GPU_HOST)
    argv = plan.disk_manager_argv
    assert argv is not None
    assert argv[argv.index("--events-endpoint") + 1] == "tcp://*:5559"
    assert plan.picker_labels == {"kv-events-port": "5557", "kv-replay-port": "5558", "kv-disk-events-port": "5559"}
    rendered = plan.render()
    assert "kv-events-port=5557;kv-replay-port=5558;kv-disk-events-port=5559" in rendered


def test_without_a_disk_tier_the_picker_gets_no_disk_label():
    plan = build_plan(LaunchOptions(model="/m", pod_ip="10.0.0.7"), GPU_HOST)
    assert plan.disk_manager_argv is None and "kv-disk-events-port" not in plan.picker_labels


@pytest.mark.slow
async def test_the_picker_stops_seeing_disk_blocks_the_planned_manager_deletes(tmp_path):
    base = consecutive_free_ports(3)  # engine events, replay, and the derived disk-manager port
    [http_port] = free_ports(1)
    root = tmp_path / "tier"
    root.mkdir()
    opts = LaunchOptions(model="/m", served_model_name="m", pod_ip="127.0.0.1", port=8000, block_size=BLOCK,
                         cpu_offload_bytes=1 << 30, disk_path=str(root), disk_bytes=100 * KB,
                         kv_events_port=base, kv_replay_port=base + 1)
    plan = build_plan(opts, GPU_HOST)
    assert plan.disk_manager_argv is not None and plan.topic is not None
    assert plan.picker_labels["kv-disk-events-port"] == str(base + 2)

    # The engine stand-in: vLLM's own publisher, which announced the disk copies.
    engine = KVEventPublisher(f"tcp://127.0.0.1:{base}", replay_endpoint=f"tcp://127.0.0.1:{base + 1}",
                              topic=plan.topic, bind=True)
    registry = CollectorRegistry()
    index = KVBlockIndex(BLOCK, 10_000, metrics=KVIndexMetrics(registry))
    endpoints = EndpointRegistry()
    endpoints.set_endpoints([EndpointSpec("127.0.0.1", 8000, dict(plan.picker_labels))])
    sub = KVEventSubscriber(index, SubscriberConfig(replay_timeout_s=2.0), endpoints, KVSubscriberMetrics(registry))
    keys = [index.keyer.request_keys(tokens_of(i), "m")[0] for i in range(12)]
    manager = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.engine.disk_tier.cli", *plan.disk_manager_argv[3:],
        "--http-host", "127.0.0.1", "--http-port", str(http_port), "--interval", "0.2", "--min-age", "0")
    try:
        await sub.start()
        async with aiohttp.ClientSession() as session:
            await until_ready(session, f"http://127.0.0.1:{http_port}/ready")
        for _ in range(100):  # PUB drops what it sends before the subscriber is attached
            engine.publish([BlockStored([block_hash_int(i)], None, tokens_of(i), BLOCK, None, "STORAGE", None)
                            for i in range(12)])
            await asyncio.sleep(0.1)
            if all(Tier.DISK in index.tiers_of(k, "127.0.0.1:8000") for k in keys):
                break
        await asyncio.sleep(1.0)  # the subscriber's second socket attaches to the manager's publisher
        # vLLM writes twelve 10 KB blocks on a 100 KB budget: above the 85 % mark, the oldest go
        # down to 50 %. Before the fix nothing told the picker.
        for i in range(12):
            write_block(root, i, 10 * KB, age_s=1000 - i)
        await wait_until(lambda: sum(Tier.DISK not in index.tiers_of(k, "127.0.0.1:8000") for k in keys) >= 7,
                         "the picker to drop the deleted disk blocks", timeout=15.0)
        gone = {i for i in range(12) if not any(root.rglob(f"{(i.to_bytes(4, 'big') * 8).hex()}.bin"))}
        assert len(gone) == 7  # 120 KB -> at most 50 KB
        assert gone == {i for i, k in enumerate(keys) if Tier.DISK not in index.tiers_of(k, "127.0.0.1:8000")}
    finally:
        manager.terminate()
        await manager.wait()
        await sub.stop()
        engine.close()
