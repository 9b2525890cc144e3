"""Static and file discovery feeding the endpoint registry."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from epp.datalayer.discovery import EndpointFileError, FileDiscovery, StaticDiscovery, load_endpoint_file
from epp.datalayer.registry import EndpointRegistry, EndpointSpec


def names(registry: EndpointRegistry) -> set[str]:
    return {ep.name for ep in registry.snapshot()}


async def test_static_discovery_publishes_once_with_labels():
    registry = EndpointRegistry()
    discovery = StaticDiscovery(registry, "10.0.0.1:8000#role=decode;zone=a, [fd00::2]:8001")
    assert not registry.synced
    assert await discovery.start() is True
    assert registry.synced
    assert names(registry) == {"10.0.0.1:8000", "[fd00::2]:8001"}
    assert dict(registry.get("10.0.0.1:8000").labels) == {"role": "decode", "zone": "a"}
    await discovery.stop()
    assert len(registry) == 2  # stopping keeps the last view


async def test_static_discovery_from_specs():
    registry = EndpointRegistry()
    discovery = StaticDiscovery(registry, [EndpointSpec("127.0.0.1", 9000, {"a": "b"}, 9100)])
    await discovery.start()
    assert registry.get("127.0.0.1:9000").metrics_hostport == "127.0.0.1:9100"
    await discovery.stop()


def write(path, text: str) -> None:
    # Atomic replace, as config management tools do; also changes the inode.
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


async def test_file_discovery_follows_changes_and_keeps_view_on_bad_file(tmp_path, caplog):
    path = tmp_path / "endpoints.yaml"
    write(path, """
endpoints:
  - address: 10.0.0.1
    port: 8000
    labels: {role: prefill, gpu: 1, spot: true}
  - 10.0.0.2:8000#role=decode
""")
    registry = EndpointRegistry()
    discovery = FileDiscovery(registry, path, poll_interval=0.02)
    assert await discovery.start()
    assert names(registry) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert dict(registry.get("10.0.0.1:8000").labels) == {"role": "prefill", "gpu": "1", "spot": "true"}

    write(path, "endpoints:\n  - {address: 10.0.0.3, port: 9000, metricsPort: 9100}\n")
    for _ in range(200):
        if names(registry) == {"10.0.0.3:9000"}:
            break
        await asyncio.sleep(0.01)
    assert names(registry) == {"10.0.0.3:9000"}
    assert registry.get("10.0.0.3:9000").metrics_port == 9100

    errors_before = discovery.errors
    write(path, "endpoints:\n  - {address: not-an-ip, port: 9000}\n")
    for _ in range(200):
        if discovery.errors > errors_before:
            break
        await asyncio.sleep(0.01)
    assert discovery.errors == errors_before + 1
    assert names(registry) == {"10.0.0.3:9000"}  # previous view kept
    assert "not an IP address" in caplog.text
    await asyncio.sleep(0.1)
    assert discovery.errors == errors_before + 1  # an unchanged bad file is not re-read

    write(path, json.dumps([{"address": "10.0.0.4", "port": 8000}]))  # JSON is YAML too
    for _ in range(200):
        if names(registry) == {"10.0.0.4:8000"}:
            break
        await asyncio.sleep(0.01)
    assert names(registry) == {"10.0.0.4:8000"}
    await discovery.stop()


async def test_file_discovery_is_not_synced_until_a_good_read(tmp_path):
    path = tmp_path / "endpoints.json"
    registry = EndpointRegistry()
    discovery = FileDiscovery(registry, path, poll_interval=0.02)
    assert await discovery.start(first_sync_timeout=0.1) is False  # missing file
    assert not registry.synced
    write(path, "{not json")
    await asyncio.sleep(0.1)
    assert not registry.synced
    write(path, '{"endpoints": []}')
    for _ in range(200):
        if registry.synced:
            break
        await asyncio.sleep(0.01)
    assert registry.synced and len(registry) == 0  # an empty pool is a valid view
    await discovery.stop()


@pytest.mark.parametrize("text, message", [
    ("endpoints: {a: 1}", "'endpoints' must be a list"),
    ("endpoints: [{address: 10.0.0.1, port: 0}]", "endpoints[0].port: must be an integer port"),
    ("endpoints: [{address: 10.0.0.1, port: 'http'}]", "endpoints[0].port"),
    ("endpoints: [{name: a, address: 10.0.0.1, port: '80'}, {name: a, address: 10.0.0.2, port: '80'}]",
     "endpoints[1].name: 'a' is already the name of endpoints[0]"),
    ("endpoints: [{address: 10.0.0.1, port: 80, weight: 2}]", "unknown field(s) ['weight']"),
    ("endpoints: [{address: 10.0.0.1, port: 80, labels: [a]}]", "endpoints[0].labels"),
    ("endpoints: [{address: 10.0.0.1, port: 80, metricsPort: 70000}]", "endpoints[0].metricsPort"),
    ("endpoints: ['10.0.0.1']", "endpoints[0]: endpoint '10.0.0.1': expected ip:port"),
    ("endpoints: [10.0.0.1:80, 10.0.0.1:80]", "duplicate endpoint(s) ['10.0.0.1:80']"),
    ("pods: []", "unknown top-level field(s) ['pods']"),
    ("endpoints: [", "cannot decode"),
])
def test_bad_endpoint_files_are_explained(text, message):
    with pytest.raises(EndpointFileError) as info:
        load_endpoint_file(text, "endpoints.yaml")
    assert message in str(info.value)
