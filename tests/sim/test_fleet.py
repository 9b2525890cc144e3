"""The fleet launcher: Python API, worker processes and the command line."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import sys
import tempfile
from pathlib import Path

import aiohttp

from epp.engine.sim import FleetConfig, SimFleet
from epp.engine.sim.fleet import default_tokenizer_dir
from tests.support.ports import consecutive_free_ports

ENDPOINTS = re.compile(r"^127\.0\.0\.1:\d+(,127\.0\.0\.1:\d+)*$")


async def who_answers(endpoint: str) -> str:
    async with aiohttp.ClientSession() as s, s.post(f"http://{endpoint}/v1/completions",
                                                      json={"prompt": "hi", "max_tokens": 1}) as r:
        assert r.status == 200
        return r.headers["x-sim-replica"]


async def test_in_process_fleet_with_heterogeneous_profiles(tokenizer_dir):
    config = FleetConfig(replicas=3, tokenizer_dir=tokenizer_dir, profiles=["fast", "fast*2"], kv_events=False,
                         labels={"pool": "demo"})
    async with SimFleet(config) as fleet:
        assert ENDPOINTS.match(fleet.endpoints_arg)
        assert len(set(fleet.endpoints)) == 3
        assert [d["profile"] for d in fleet.info] == ["fast", "fastx2", "fast"]
        assert fleet.info[1]["labels"] == {"replica": "sim-1", "profile": "fastx2", "pool": "demo"}
        assert [await who_answers(e) for e in fleet.endpoints] == ["sim-0", "sim-1", "sim-2"]
    assert fleet.replicas == []


async def test_worker_processes_host_the_replicas(tokenizer_dir):
    async with SimFleet(FleetConfig(replicas=3, processes=2, tokenizer_dir=tokenizer_dir)) as fleet:
        assert fleet.replicas == []  # not in this process
        assert [await who_answers(e) for e in fleet.endpoints] == ["sim-0", "sim-1", "sim-2"]
        assert all(d["kv_events_endpoint"].startswith("tcp://127.0.0.1:") for d in fleet.info)
        procs = list(fleet._procs)
    assert all(p.returncode is not None for p in procs)


async def start_fleet_command(tokenizer_dir: str) -> tuple[asyncio.subprocess.Process, int, str]:
    """Start `python -m epp.engine.sim fleet` on two consecutive free ports; returns (process, base, stdout line).

    Another process can still take a port between the check and the fleet's bind, so a start that lost
    that race is tried again (up to 3 times); any other failure is raised with the fleet's stderr.
    """
    for attempt in range(3):
        base = consecutive_free_ports(2)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epp.engine.sim", "fleet", "--replicas", "2", "--base-port", str(base),
            "--tokenizer-dir", tokenizer_dir, "--cpu-blocks", "64",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        if line:
            return proc, base, line
        stderr = (await asyncio.wait_for(proc.stderr.read(), 15)).decode()
        await proc.wait()
        if "address already in use" not in stderr.lower() or attempt == 2:
            raise AssertionError(f"the fleet printed no endpoints; stderr:\n{stderr}")
    raise AssertionError("unreachable")


async def test_command_line_prints_endpoints_and_stops_on_sigterm(tokenizer_dir):
    proc, base, line = await start_fleet_command(tokenizer_dir)
    try:
        assert line == f"127.0.0.1:{base},127.0.0.1:{base + 1}"
        details = [json.loads(await proc.stderr.readline()) for _ in range(2)]
        assert [d["endpoint"] for d in details] == line.split(",")
        assert await who_answers(line.split(",")[1]) == "sim-1"
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 15)
    assert rc == 0


async def test_command_line_reports_a_taken_port_in_one_line(tokenizer_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epp.engine.sim", "fleet", "--replicas", "1", "--base-port", str(port),
            "--tokenizer-dir", tokenizer_dir, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1 and out == b""
    assert err.decode().strip().endswith(f"('127.0.0.1', {port}): address already in use")
    assert "Traceback" not in err.decode()


async def test_centralized_mode_every_replica_dials_one_bound_subscriber(tokenizer_dir):
    import msgspec
    import zmq
    import zmq.asyncio
    from zmq.utils.monitor import parse_monitor_message

    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = FleetConfig(replicas=2, tokenizer_dir=tokenizer_dir, kv_events_connect=f"tcp://127.0.0.1:{port}")
        async with SimFleet(config) as fleet:
            for _ in range(2):
                msg = parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), 5))
                assert msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
            await sub.poll(50)  # the SUB attaches the connections and sends its subscription
            await asyncio.sleep(0.15)  # and the publishers receive it
            async with aiohttp.ClientSession() as s:
                for e in fleet.endpoints:
                    async with s.post(f"http://{e}/v1/completions", json={"prompt": "word " * 40, "max_tokens": 1}) as r:
                        assert r.status == 200
            topics = set()
            while len(topics) < 2:
                topic, _seq, payload = await asyncio.wait_for(sub.recv_multipart(), 3)
                assert msgspec.msgpack.decode(payload)[1][0]["type"] == "BlockStored"
                topics.add(topic.decode())
            assert topics == {f"kv@{e}@sim-model" for e in fleet.endpoints}
    finally:
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)


def test_the_shared_tokenizer_copy_is_readable_by_every_user_of_the_host(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = Path(default_tokenizer_dir(seed=3))
    assert shared.parent == tmp_path
    assert shared.stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o004 for f in shared.iterdir())  # the files too
