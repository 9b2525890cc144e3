"""Block-file naming of vLLM's fs tier, and the manager's HTTP side (/ready, /metrics) and CLI."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from disk_tier_files import write_block

from epp.engine.disk_tier import cli
from epp.engine.disk_tier.http import build_app
from epp.engine.disk_tier.manager import DiskTierConfig, DiskTierManager
from epp.engine.disk_tier.naming import BlockFileKey, is_temp_name, vllm_fs_block_key
from epp.engine.kv_publisher import KVEventPublisher
from epp.netutil import free_ports


def test_vllm_fs_layout_maps_to_digest_group_and_event_hash():
    digest = bytes(range(32))
    rel = f"tiny_0123456789ab_r0/{digest.hex()[:3]}/{digest.hex()[3:5]}_g2/{digest.hex()}.bin"
    key = vllm_fs_block_key(rel)
    assert key == BlockFileKey(digest, 2)
    assert key.event_hash() == int.from_bytes(digest[-8:], "big")
    assert key.event_hash(int_hashes=False) == digest


@pytest.mark.parametrize("rel", ["tiny_0123456789ab/config.json", "a/b/xyz.bin", "a/b/abc.bin"])
def test_files_that_are_not_blocks_map_to_nothing(rel):
    assert vllm_fs_block_key(rel) is None


def test_temp_names_are_recognised():
    assert is_temp_name("00ff.bin_8812.tmp") and is_temp_name(".o_direct_probe_1.tmp")
    assert not is_temp_name("00ff.bin")


async def test_ready_is_503_before_the_first_scan_then_200_with_status(tmp_path):
    write_block(tmp_path, 1, 1000)
    manager = DiskTierManager(DiskTierConfig(root=tmp_path, budget_bytes=10_000, min_free_bytes=0))
    async with TestClient(TestServer(build_app(manager))) as client:
        assert (await client.get("/ready")).status == 503
        await manager.run_cycle()
        resp = await client.get("/ready")
        assert resp.status == 200
        body = await resp.json()
        assert body["tier_healthy"] is True and body["usage_bytes"] == 1000
        text = await (await client.get("/metrics")).text()
        assert "epp_disk_tier_usage_bytes 1000.0" in text and "epp_disk_tier_budget_bytes 10000.0" in text
        assert "epp_disk_tier_healthy 1.0" in text


async def test_cli_serve_evicts_and_answers_http_until_stopped(tmp_path):
    for i in range(9):
        write_block(tmp_path, i, 1000, age_s=1000 - i)
    (http_port,) = free_ports(1)
    vllm = KVEventPublisher("tcp://127.0.0.1:*", topic="kv@1.2.3.4:8000@m")  # stands in for the replica
    args = cli.build_parser().parse_args(
        ["--root", str(tmp_path), "--budget-bytes", "10000", "--interval", "0.05",
         "--http-host", "127.0.0.1", "--http-port", str(http_port),
         "--events-endpoint", "tcp://127.0.0.1:*", "--topic", "kv@1.2.3.4:8000@m",
         "--vllm-events-endpoint", vllm.bound_endpoint])
    stop = asyncio.Event()
    task = asyncio.create_task(cli.serve(args, stop))
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                try:
                    async with session.get(f"http://127.0.0.1:{http_port}/metrics") as resp:
                        text = await resp.text()
                        if "epp_disk_tier_evictions_total 4.0" in text:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
        assert "epp_disk_tier_evictions_total 4.0" in text
        assert "epp_disk_tier_events_published_total 4.0" in text
        assert "epp_disk_tier_chunk_records 0.0" in text  # following the replica's events
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        vllm.close()
    assert len(list(tmp_path.rglob("*.bin"))) == 5


def test_cli_refuses_bad_watermarks(tmp_path, capsys):
    assert cli.main(["--root", str(tmp_path), "--budget-bytes", "1GiB", "--low-watermark", "0.9"]) == 2
    assert "watermarks" in capsys.readouterr().err
