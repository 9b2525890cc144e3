"""The config's `dataLayer` reaches the scraper: scheme, path and TLS of `metrics-data-source`, against a real
local HTTPS `/metrics` server with a self-signed certificate; and a config that turns the metrics source off."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import time
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from epp.datalayer.registry import EndpointSpec
from epp.server.tls import self_signed_pair
from tests.support.configs import endpoint_picker_config, plugin
from tests.support.pods import start_picker
from tests.support.vllm_metrics import VllmState, vllm_metrics_page

PATH = "/custom/metrics"


def ip_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (an IP SAN, so it verifies against itself as the CA) and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vllm-metrics")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "metrics.crt", directory / "metrics.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class HttpsMetricsServer:
    """A real loopback HTTPS server with a vLLM `/metrics` page at PATH only."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.page = vllm_metrics_page(VllmState(waiting=7, running=2, kv_usage=0.25))
        self.hits = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        return web.Response(text=self.page, content_type="text/plain")

    async def start(self) -> HttpsMetricsServer:
        app = web.Application()
        app.router.add_get(PATH, self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.context)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def https_server(tmp_path):
    cert, key = ip_certificate(tmp_path)
    server = await HttpsMetricsServer(cert, key).start()
    yield server, cert
    await server.stop()


def scraping_config(**source: object) -> str:
    return endpoint_picker_config(
        [plugin("metrics-data-source", **source), "core-metrics-extractor", "queue-scorer"], ["queue-scorer"],
        dataLayer={"sources": [{"pluginRef": "metrics-data-source",
                                "extractors": [{"pluginRef": "core-metrics-extractor"}]}]})


async def until(condition, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)



async def test_https_with_the_configured_ca_and_path_is_scraped(https_server):
    metrics, cert = https_server
    picker = await start_picker(scraping_config(scheme="https", path=PATH, insecureSkipVerify=False,
                                                caCertPath=str(cert)), [EndpointSpec("127.0.0.1", metrics.port)])
    try:
        hostport = f"127.0.0.1:{metrics.port}"
        await until(lambda: picker.endpoints.get(hostport).metrics.waiting_queue_size == 7, "the HTTPS scrape")
        assert picker.endpoints.get(hostport).metrics.kv_cache_usage == 0.25
        assert picker.scraper.scheme == "https" and picker.scraper.path == PATH
    finally:
        await picker.stop(0)


async def test_https_certificate_not_trusted_fails_the_scrape_when_verifying(https_server):
    metrics, _ = https_server
    picker = await start_picker(scraping_config(scheme="https", path=PATH, insecureSkipVerify=False),
                                [EndpointSpec("127.0.0.1", metrics.port)])
    try:
        hostport = f"127.0.0.1:{metrics.port}"
        registry = picker.metrics.registry

        def failures() -> float:
            return registry.get_sample_value("epp_metrics_scrape_errors_total",
                                             {"endpoint": hostport, "reason": "connect"}) or 0.0

        await until(lambda: failures() >= 3, "three failed TLS handshakes")
        assert metrics.hits == 0 and picker.endpoints.get(hostport).metrics.update_time == 0.0
        assert not picker.endpoints.get(hostport).healthy
    finally:
        await picker.stop(0)


async def test_llm_d_default_skips_verification_of_a_self_signed_certificate(tmp_path):
    key_pem, cert_pem = self_signed_pair("vllm")  # no IP SAN: it could not be verified for 127.0.0.1
    (tmp_path / "c.pem").write_bytes(cert_pem)
    (tmp_path / "k.pem").write_bytes(key_pem)
    metrics = await HttpsMetricsServer(tmp_path / "c.pem", tmp_path / "k.pem").start()
    picker = await start_picker(scraping_config(scheme="https", path=PATH), [EndpointSpec("127.0.0.1", metrics.port)])
    try:
        hostport = f"127.0.0.1:{metrics.port}"
        await until(lambda: picker.endpoints.get(hostport).metrics.waiting_queue_size == 7, "the HTTPS scrape")
    finally:
        await picker.stop(0)
        await metrics.stop()


async def test_plain_http_against_the_https_server_is_no_scrape(https_server):
    metrics, _ = https_server
    picker = await start_picker(scraping_config(path=PATH), [EndpointSpec("127.0.0.1", metrics.port)])
    try:
        hostport = f"127.0.0.1:{metrics.port}"
        await until(lambda: not picker.endpoints.get(hostport).healthy, "the endpoint to be marked unhealthy")
        assert picker.endpoints.get(hostport).metrics.update_time == 0.0
    finally:
        await picker.stop(0)


async def test_no_metrics_source_means_no_scraper(https_server):
    metrics, _ = https_server
    config = endpoint_picker_config(["queue-scorer"], ["queue-scorer"], dataLayer={"injectDefaults": False})
    picker = await start_picker(config, [EndpointSpec("127.0.0.1", metrics.port)])
    try:
        assert picker.scraper is None and picker.pipeline.scrape is None
    finally:
        await picker.stop(0)
