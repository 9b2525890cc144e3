"""The peer protocol: the checked-in generated code is what proto/ generates, and versions are checked."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from epp.netutil import free_ports
from epp.peer.node import PROTOCOL_VERSION, PeerNode
from epp.peer.v1 import peer_pb2 as pb
from epp.peer.v1 import peer_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("peer_pb2.py", "peer_pb2.pyi", "peer_pb2_grpc.py")


# Lines of the generated code that name the generator's or the runtime's version: they change with every
# grpcio-tools release and say nothing about the protocol, so the comparison leaves them out.
_VERSION_STAMP = re.compile(rb"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s+\d+,)$", re.M)


def _without_version_stamps(path: Path) -> bytes:
    return _VERSION_STAMP.sub(b"", path.read_bytes())


def test_checked_in_code_is_what_proto_generate_makes(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (test extras) regenerates the code")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    str(ROOT / "proto/epp/peer/v1/peer.proto")], check=True)
    for name in GENERATED:
        assert _without_version_stamps(tmp_path / "epp/peer/v1" / name) \
            == _without_version_stamps(ROOT / "epp/peer/v1" / name), f"epp/peer/v1/{name} is stale: run proto/generate.sh"


def test_the_checked_in_code_registers_the_peer_protocol():
    # The descriptor the checked-in code registers is the .proto's, whatever generator made it.
    source = (ROOT / "epp/peer/v1/peer_pb2_grpc.py").read_bytes()
    assert re.findall(rb"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", source, re.M), "the grpc stub names its version"
    assert pb.DESCRIPTOR.name == "epp/peer/v1/peer.proto"
    assert [m.name for m in pb.DESCRIPTOR.services_by_name["PickerPeers"].methods] == ["Subscribe", "Snapshot"]


def test_the_runtime_pins_cover_what_the_checked_in_code_requires():
    # The generated stub refuses to import under an older grpcio, the messages under an older protobuf:
    # pyproject's lower bounds must be at least those the code names.
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lower_bounds = dict(re.fullmatch(r"([a-z0-9-]+)>=([0-9.]+).*", d).groups() for d in dependencies if ">=" in d)
    grpc_needed = re.search(rb"GRPC_GENERATED_VERSION = '([0-9.]+)'",
                            (ROOT / "epp/peer/v1/peer_pb2_grpc.py").read_bytes()).group(1).decode()
    proto_needed = re.search(rb"Protobuf Python Version: ([0-9.]+)",
                             (ROOT / "epp/peer/v1/peer_pb2.py").read_bytes()).group(1).decode()
    for name, needed in (("grpcio", grpc_needed), ("protobuf", proto_needed)):
        lowest = tuple(int(part) for part in lower_bounds[name].split("."))
        assert lowest >= tuple(int(part) for part in needed.split(".")), \
            f"pyproject allows {name}>={lower_bounds[name]} but epp/peer/v1 needs >={needed}"


async def test_a_peer_of_another_protocol_version_is_refused():
    [port] = free_ports(1)
    node = PeerNode(host="127.0.0.1", port=port, peers=[])
    await node.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PickerPeersStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Subscribe(pb.SubscribeRequest(protocol_version=PROTOCOL_VERSION + 1)):
                    pass
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Snapshot(pb.SnapshotRequest(protocol_version=0)):
                    pass
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await node.stop()


async def test_a_subscriber_that_falls_behind_loses_the_oldest_decisions_and_sees_the_gap():
    [port] = free_ports(1)
    registry = CollectorRegistry()
    publisher = PeerNode(host="127.0.0.1", port=port, peers=[], outbox_limit=4, metrics_registry=registry)
    await publisher.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.PickerPeersStub(channel).Subscribe(
                pb.SubscribeRequest(protocol_version=PROTOCOL_VERSION, subscriber_id="slow"))
            hello = await call.read()
            assert (hello.picker_id, hello.first_sequence, len(hello.decisions)) == (publisher.picker_id, 0, 0)
            # Ten routes published before the subscriber reads: its outbox keeps the newest four.
            for i in range(10):
                publisher.publish_prefix(f"10.0.0.{i}:8000", [i, i + 1], 100)
            batch = await call.read()
            assert batch.first_sequence == 7
            assert [d.prefix_routed.endpoint for d in batch.decisions] == [f"10.0.0.{i}:8000" for i in range(6, 10)]
            assert list(batch.decisions[-1].prefix_routed.block_hashes) == [9, 10]
            assert registry.get_sample_value("epp_peer_decisions_dropped_total") == 6
            call.cancel()
    finally:
        await publisher.stop()


async def test_a_decision_after_a_quiet_interval_is_sent_at_once_and_a_burst_waits_for_one_batch():
    [port] = free_ports(1)
    publisher = PeerNode(host="127.0.0.1", port=port, peers=[], flush_interval_s=1.0)
    await publisher.start()
    loop = asyncio.get_running_loop()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.PickerPeersStub(channel).Subscribe(
                pb.SubscribeRequest(protocol_version=PROTOCOL_VERSION, subscriber_id="peer"))
            await call.read()
            published = loop.time()
            publisher.publish_prefix("10.0.0.1:8000", [1], 100)
            first = await call.read()
            sent_first = loop.time()
            # Not held for the flush interval: the link was quiet.
            assert [d.prefix_routed.endpoint for d in first.decisions] == ["10.0.0.1:8000"]
            assert sent_first - published < 0.5
            # Two more within the interval travel together, one interval after the first batch.
            publisher.publish_prefix("10.0.0.2:8000", [2], 100)
            await asyncio.sleep(0.1)
            publisher.publish_prefix("10.0.0.3:8000", [3], 100)
            burst = await call.read()
            assert [d.prefix_routed.endpoint for d in burst.decisions] == ["10.0.0.2:8000", "10.0.0.3:8000"]
            assert loop.time() - sent_first >= 0.9
            call.cancel()
    finally:
        await publisher.stop()
