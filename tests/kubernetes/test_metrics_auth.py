"""`--metrics-endpoint-auth`: the metrics port answers only a bearer token the Kubernetes API
authenticates (TokenReview) and authorizes (SubjectAccessReview, `get` on the path); answers are
cached, bounded, counted. Against the API double (bench/support/k8s_apiserver.py), whose
READER_TOKEN may read /metrics and STRANGER_TOKEN may not. `--metrics-cert-dir` and
`--metrics-client-ca-file` put the port behind TLS and client certificates."""

from __future__ import annotations

import datetime
import ssl

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from bench.support.k8s_apiserver import READER_TOKEN, READER_USER, STRANGER_TOKEN, STRANGER_USER
from epp.kube.client import load_api_client
from epp.kube.reviews import AccessDecision, KubernetesReviews, ReviewError, UserInfo
from epp.server.metrics_auth import (
    ALLOWED_TTL_S,
    DENIED_TTL_S,
    TOKEN_TTL_S,
    MetricsAuth,
    aiohttp_guard,
)
from epp.server.runner import EppServer
from tests.support.extproc import options, simple_pipeline


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingReviews:
    """Reviews as a fixed table says, counting the calls (the double's answers without HTTP)."""

    def __init__(self) -> None:
        self.users = {"good": UserInfo("alice"), "nosy": UserInfo("mallory")}
        self.calls = {"token": 0, "access": 0}
        self.failing = False

    async def authenticate(self, token: str) -> UserInfo | None:
        self.calls["token"] += 1
        if self.failing:
            raise ReviewError("TokenReview: HTTP 503 from the API server")
        return self.users.get(token)

    async def authorize(self, user: UserInfo, verb: str, path: str) -> AccessDecision:
        self.calls["access"] += 1
        return AccessDecision(user.username == "alice" and verb == "get" and path == "/metrics", "rbac")

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic abc", "bearer",
                                    "Bearer " + "x" * (16 * 1024 + 1)])
async def test_no_usable_bearer_token_is_401_without_asking_the_api(header):
    reviews = CountingReviews()
    auth = MetricsAuth(reviews, CollectorRegistry())  # type: ignore[arg-type]
    answer = await auth.check(header, "GET", "/metrics")
    assert (answer.status, answer.message) == (401, "Unauthorized")
    assert reviews.calls == {"token": 0, "access": 0}


async def test_answers_as_controller_runtime_s_filter_gives_them():
    reviews = CountingReviews()
    registry = CollectorRegistry()
    auth = MetricsAuth(reviews, registry)  # type: ignore[arg-type]
    assert (await auth.check("Bearer good", "GET", "/metrics")).status == 200
    assert (await auth.check("bearer good", "GET", "/metrics")).status == 200  # the scheme is case-blind
    denied = await auth.check("Bearer nosy", "GET", "/metrics")
    assert (denied.status, denied.message) == (403, "Authorization denied for user mallory")
    assert (await auth.check("Bearer good", "POST", "/metrics")).status == 403  # the verb is the method
    assert (await auth.check("Bearer good", "GET", "/debug/state")).status == 403  # and the path is the path
    assert (await auth.check("Bearer unknown", "GET", "/metrics")).status == 401
    reviews.failing = True
    failed = await auth.check("Bearer other", "GET", "/metrics")
    assert (failed.status, failed.message) == (500, "Authentication failed")
    assert [sample(registry, "epp_metrics_auth_requests_total", code=c) for c in ("200", "401", "403", "500")] == [
        2, 1, 3, 1]
    assert sample(registry, "epp_metrics_auth_reviews_total", review="token", outcome="error") == 1
    assert sample(registry, "epp_metrics_auth_reviews_total", review="access", outcome="denied") == 3


async def test_reviews_are_cached_for_controller_runtime_s_times():
    reviews, clock = CountingReviews(), Clock()
    auth = MetricsAuth(reviews, CollectorRegistry(), clock=clock)  # type: ignore[arg-type]
    for _ in range(5):
        assert (await auth.check("Bearer good", "GET", "/metrics")).status == 200
        assert (await auth.check("Bearer nosy", "GET", "/metrics")).status == 403
        assert (await auth.check("Bearer unknown", "GET", "/metrics")).status == 401
    assert reviews.calls == {"token": 3, "access": 2}
    clock.now += DENIED_TTL_S + 1  # the denial is asked again; the allowance and the tokens are still known
    await auth.check("Bearer good", "GET", "/metrics")
    await auth.check("Bearer nosy", "GET", "/metrics")
    assert reviews.calls == {"token": 3, "access": 3}
    clock.now += TOKEN_TTL_S  # tokens (accepted or not) a minute
    await auth.check("Bearer good", "GET", "/metrics")
    await auth.check("Bearer unknown", "GET", "/metrics")
    assert reviews.calls == {"token": 5, "access": 3}
    clock.now += ALLOWED_TTL_S  # an allowance five minutes
    await auth.check("Bearer good", "GET", "/metrics")
    assert reviews.calls["access"] == 4


async def test_the_caches_are_bounded_least_recently_used_out():
    reviews = CountingReviews()
    reviews.users.update({f"t{i}": UserInfo(f"u{i}") for i in range(10)})
    registry = CollectorRegistry()
    auth = MetricsAuth(reviews, registry, capacity=4)  # type: ignore[arg-type]
    for i in range(10):
        await auth.check(f"Bearer t{i}", "GET", "/metrics")
    assert len(auth.tokens) == 4 and len(auth.access) == 4
    assert sample(registry, "epp_metrics_auth_cache_entries", cache="tokens") == 4
    assert sample(registry, "epp_metrics_auth_cache_evictions_total", cache="tokens") == 6
    before = reviews.calls["token"]
    await auth.check("Bearer t9", "GET", "/metrics")  # still cached
    await auth.check("Bearer t0", "GET", "/metrics")  # evicted long ago
    assert reviews.calls["token"] == before + 1


async def test_the_reviews_against_the_api_double(api, kubeconfig):
    reviews = KubernetesReviews(await load_api_client(kubeconfig))
    try:
        reader = await reviews.authenticate(READER_TOKEN)
        stranger = await reviews.authenticate(STRANGER_TOKEN)
        assert reader is not None and reader.username == READER_USER and "system:authenticated" in reader.groups
        assert stranger is not None and stranger.username == STRANGER_USER
        assert await reviews.authenticate("forged") is None
        assert (await reviews.authorize(reader, "get", "/metrics")).allowed
        assert not (await reviews.authorize(reader, "get", "/debug/state")).allowed
        denied = await reviews.authorize(stranger, "get", "/metrics")
        assert not denied.allowed and "no RBAC policy matched" in denied.reason
        api.fail_next(1, 503)
        with pytest.raises(ReviewError, match="HTTP 503"):
            await reviews.authenticate(READER_TOKEN)
        assert api.reviews == {"TokenReview": 3, "SubjectAccessReview": 3}  # the failed one never got answered
    finally:
        await reviews.close()
    # The picker's own credentials must be good: a token the API does not know is a ReviewError.
    forged = KubernetesReviews(await load_api_client(api.write_kubeconfig(kubeconfig + ".bad", token="nope")))
    try:
        with pytest.raises(ReviewError, match="HTTP 401"):
            await forged.authenticate(READER_TOKEN)
    finally:
        await forged.close()


async def get(url: str, token: str | None = None, **kw) -> tuple[int, str, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers, **kw) as response:
        return response.status, await response.text(), dict(response.headers)


async def test_the_picker_s_metrics_port_behind_the_api_double(api, kubeconfig):
    server = EppServer(options(metrics_auth=True, kubeconfig=kubeconfig, enable_debug_endpoint=True),
                       pipeline=simple_pipeline())
    await server.start()
    url = f"http://127.0.0.1:{server.metrics_port}"
    try:
        code, text, headers = await get(f"{url}/metrics")
        assert (code, text, headers["WWW-Authenticate"]) == (401, "Unauthorized\n", "Bearer")
        assert (await get(f"{url}/metrics", "forged"))[:2] == (401, "Unauthorized\n")
        assert (await get(f"{url}/metrics", STRANGER_TOKEN))[:2] == (
            403, f"Authorization denied for user {STRANGER_USER}\n")
        code, text, _ = await get(f"{url}/metrics", READER_TOKEN)
        assert code == 200 and "inference_pool_ready_pods" in text
        assert 'epp_metrics_auth_requests_total{code="401"} 2.0' in text
        # /debug is the port's too: reading it is another path, which the reader is not granted.
        assert (await get(f"{url}/debug/state", READER_TOKEN))[0] == 403
        reviews = dict(api.reviews)
        for _ in range(3):
            assert (await get(f"{url}/metrics", READER_TOKEN))[0] == 200
        assert api.reviews == reviews  # cached
    finally:
        await server.stop(0)


async def test_the_supervisor_s_aiohttp_page_behind_the_same_guard(api, kubeconfig):
    """Under `--workers N` the supervisor serves the pod's page with aiohttp: the same answers."""
    auth = MetricsAuth(KubernetesReviews(await load_api_client(kubeconfig)), CollectorRegistry())

    async def page(_request: web.Request) -> web.Response:
        return web.Response(text="page")

    app = web.Application(middlewares=[aiohttp_guard(auth)])
    app.router.add_get("/metrics", page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        assert [(await get(f"http://127.0.0.1:{port}/metrics", t))[:2] for t in (None, STRANGER_TOKEN, READER_TOKEN)] \
            == [(401, "Unauthorized\n"), (403, f"Authorization denied for user {STRANGER_USER}\n"), (200, "page")]
    finally:
        await runner.cleanup()
        await auth.close()


def _certificate(subject: str, key, issuer_key=None, issuer: str | None = None, ca: bool = False,
                 names: tuple[str, ...] = ()) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer or subject)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


async def test_metrics_over_tls_with_client_certificates(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = _certificate("metrics-ca", ca_key, ca=True)
    (tmp_path / "ca.crt").write_bytes(ca)
    (tmp_path / "tls.crt").write_bytes(_certificate("localhost", server_key, ca_key, "metrics-ca",
                                                    names=("localhost",)))
    (tmp_path / "tls.key").write_bytes(_key_pem(server_key))
    (tmp_path / "client.crt").write_bytes(_certificate("prometheus", client_key, ca_key, "metrics-ca"))
    (tmp_path / "client.key").write_bytes(_key_pem(client_key))
    server = EppServer(options(metrics_cert_dir=str(tmp_path), metrics_client_ca_file=str(tmp_path / "ca.crt")),
                       pipeline=simple_pipeline())
    await server.start()
    url = f"https://localhost:{server.metrics_port}/metrics"
    try:
        client = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        client.load_cert_chain(str(tmp_path / "client.crt"), str(tmp_path / "client.key"))
        code, text, _ = await get(url, ssl=client)
        assert code == 200 and "inference_pool_ready_pods" in text
        anonymous = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        with pytest.raises(aiohttp.ClientError):  # no client certificate: the handshake is refused
            await get(url, ssl=anonymous)
        with pytest.raises(aiohttp.ClientError):  # plaintext is not served
            await get(f"http://localhost:{server.metrics_port}/metrics")
        code, _, _ = await get(url, ssl=client)  # the refused clients left the server serving
        assert code == 200
    finally:
        await server.stop(0)
