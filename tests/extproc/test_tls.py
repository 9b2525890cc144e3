"""--secure-serving: the ext_proc port speaks TLS (h2), with a given certificate or a self-signed one."""

from __future__ import annotations

import asyncio
import ssl

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.server.runner import EppServer
from epp.server.tls import self_signed_pair
from tests.support.extproc import options, request_body, request_headers, simple_pipeline

BODY = b'{"model":"m","prompt":"hello"}'


async def exchange(channel: grpc.aio.Channel) -> list:
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    await call.write(request_headers())
    await call.write(request_body(BODY))
    replies = [await call.read(), await call.read()]
    await call.done_writing()
    return replies


async def test_tls_with_a_given_certificate(tmp_path):
    key, cert = self_signed_pair("localhost")
    (tmp_path / "tls.key").write_bytes(key)
    (tmp_path / "tls.crt").write_bytes(cert)
    server = EppServer(options(secure_serving=True, cert_path=str(tmp_path)), pipeline=simple_pipeline())
    await server.start()
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        async with grpc.aio.secure_channel(f"localhost:{server.grpc_port}", creds) as channel:
            replies = await exchange(channel)
        assert replies[0].HasField("request_headers") and replies[1].HasField("request_body")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):  # plaintext is refused on a TLS port
                await exchange(plain)
    finally:
        await server.stop(0)


async def test_self_signed_certificate_when_no_path_is_given():
    server = EppServer(options(secure_serving=True), pipeline=simple_pipeline())
    await server.start()
    try:
        target = f"localhost:{server.grpc_port}"
        # The certificate is generated at start: unknown to the system roots...
        async with grpc.aio.secure_channel(target, grpc.ssl_channel_credentials()) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await exchange(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # ...and once a client trusts the certificate the server presents, requests are routed.
        pem = await asyncio.to_thread(ssl.get_server_certificate, ("localhost", server.grpc_port))
        async with grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(pem.encode())) as ch:
            replies = await exchange(ch)
        assert replies[0].HasField("request_headers")
    finally:
        await server.stop(0)


def write_pair(directory, common_name: str = "localhost") -> bytes:
    """A new self-signed pair in `directory` (tls.key, tls.crt); returns the certificate."""
    key, cert = self_signed_pair(common_name)
    (directory / "tls.key.new").write_bytes(key)
    (directory / "tls.crt.new").write_bytes(cert)
    # Swapped in place as a rotated Secret's files are: each file whole, never half written.
    (directory / "tls.key.new").replace(directory / "tls.key")
    (directory / "tls.crt.new").replace(directory / "tls.crt")
    return cert


async def presented(port: int) -> bytes:
    pem = await asyncio.to_thread(ssl.get_server_certificate, ("localhost", port))
    return ssl.PEM_cert_to_DER_cert(pem)


@pytest.mark.parametrize("reload", [True, False])
async def test_enable_cert_reload_serves_a_rotated_pair_to_new_connections(tmp_path, reload):
    first = write_pair(tmp_path)
    server = EppServer(options(secure_serving=True, cert_path=str(tmp_path), enable_cert_reload=reload),
                       pipeline=simple_pipeline())
    await server.start()
    try:
        assert await presented(server.grpc_port) == ssl.PEM_cert_to_DER_cert(first.decode())
        second = write_pair(tmp_path)
        expected = second if reload else first
        assert await presented(server.grpc_port) == ssl.PEM_cert_to_DER_cert(expected.decode())
        creds = grpc.ssl_channel_credentials(root_certificates=expected)
        async with grpc.aio.secure_channel(f"localhost:{server.grpc_port}", creds) as channel:
            replies = await exchange(channel)
        assert replies[0].HasField("request_headers")
    finally:
        await server.stop(0)


def test_a_pair_caught_mid_rotation_keeps_the_current_one(tmp_path):
    from epp.server.tls import CertificateReloader

    write_pair(tmp_path)
    reloader = CertificateReloader(tmp_path)
    assert reloader.initial() is not None
    assert reloader.fetch() is None  # unchanged
    key, _ = self_signed_pair("localhost")
    (tmp_path / "tls.key").write_bytes(key)  # the new key, the old certificate: not a pair
    assert reloader.fetch() is None
    write_pair(tmp_path)
    assert reloader.fetch() is not None
    assert reloader.fetch() is None


def test_go_cipher_suite_names_become_boringssl_s_list():
    from epp.serve_flags import cipher_list

    assert cipher_list("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256,"
                       "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256") == \
        "ECDHE-RSA-AES128-GCM-SHA256:ECDHE-ECDSA-CHACHA20-POLY1305"
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="unknown or unsupported cipher suite 'TLS_RSA_WITH_RC4_128_SHA'"):
        cipher_list("TLS_RSA_WITH_RC4_128_SHA")
    with pytest.raises(argparse.ArgumentTypeError, match="names no TLS 1.2 suite"):
        cipher_list("TLS_AES_128_GCM_SHA256")


def negotiated(port: int, client_ciphers: str) -> str:
    """The cipher a TLS 1.2 client offering only `client_ciphers` agrees on with the picker (ssl.SSLError if none)."""
    import socket

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(client_ciphers)
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        return tls.cipher()[0]


def test_tls_cipher_suites_limit_what_tls_1_2_clients_get():
    """`--tls-cipher-suites` (Go's names): gRPC reads its list once as it loads, so `epp` restarts itself
    with it set before serving."""
    import os
    import subprocess
    import sys

    from epp.netutil import free_ports

    grpc_port, health_port, metrics_port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if k != "GRPC_SSL_CIPHER_SUITES"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp.cli", "--endpoints=10.0.0.1:8000", "--secure-serving",
         "--tls-cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,TLS_AES_256_GCM_SHA384",
         f"--grpc-port={grpc_port}", f"--grpc-health-port={health_port}", f"--metrics-port={metrics_port}",
         "--bind-address=127.0.0.1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(b"epp serve: ext_proc on 127.0.0.1:")
        assert negotiated(grpc_port, "ECDHE-RSA-AES128-GCM-SHA256:ECDHE-RSA-AES256-GCM-SHA384") == \
            "ECDHE-RSA-AES128-GCM-SHA256"
        with pytest.raises(ssl.SSLError):
            negotiated(grpc_port, "ECDHE-RSA-AES256-GCM-SHA384")
    finally:
        proc.terminate()
        proc.wait(15)
