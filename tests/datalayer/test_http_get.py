"""The scrape's HTTP/1.1 GET (epp/datalayer/http_get.py) against a loopback server that answers byte for byte."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from epp.datalayer.http_get import FetchFailure, KeepAliveGetter
from epp.netutil import free_ports
from epp.server.tls import self_signed_pair

PAGE = b"vllm:num_requests_waiting 3\n" * 200


def with_length(body: bytes = PAGE, *, extra: str = "", version: str = "1.1") -> bytes:
    return f"HTTP/{version} 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def chunked(body: bytes = PAGE, size: int = 1000, trailers: str = "") -> bytes:
    pieces = [body[i:i + size] for i in range(0, len(body), size)]
    out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    out += b"".join(f"{len(p):x};ext=1\r\n".encode() + p + b"\r\n" for p in pieces)
    return out + b"0\r\n" + trailers.encode() + b"\r\n"


class ScriptedServer:
    """Answers the n-th request on a connection with `answer(n)`: bytes, then what to do next."""

    def __init__(self, answer: Callable[[int], tuple[bytes, str]]) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                data, then = self.answer(n)
                n += 1
                if then == "stall":
                    await asyncio.sleep(1)
                for i in range(0, len(data), 700):  # in pieces: the parser must join them
                    writer.write(data[i:i + 700])
                    await writer.drain()
                if then == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[ScriptedServer]]]:
    servers: list[asyncio.Server] = []

    async def start(answer: Callable[[int], tuple[bytes, str]], tls: ssl.SSLContext | None = None) -> ScriptedServer:
        scripted = ScriptedServer(answer)
        server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0, ssl=tls)
        scripted.port = server.sockets[0].getsockname()[1]
        servers.append(server)
        return scripted

    yield start
    for server in servers:
        server.close()


def getter(server: ScriptedServer, **kwargs) -> KeepAliveGetter:
    return KeepAliveGetter("127.0.0.1", server.port, "/metrics", **kwargs)


async def test_two_gets_share_one_kept_alive_connection(serve):
    server = await serve(lambda n: (with_length(), "keep"))
    client = getter(server)
    assert await client.get(2) == (200, PAGE)
    assert await client.get(2) == (200, PAGE)
    assert server.connections == 1 and client.connections_opened == 1
    assert server.requests[0].startswith(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Accept-Encoding: identity" in server.requests[0]
    client.close()


async def test_https_verifies_the_server_and_keeps_the_connection(serve, tmp_path):
    key, cert = self_signed_pair("localhost")
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    server = await serve(lambda n: (with_length(), "keep"), tls)
    trusting = KeepAliveGetter("localhost", server.port, "/metrics",
                               ssl_context=ssl.create_default_context(cadata=cert.decode()))
    assert await trusting.get(2) == (200, PAGE)
    assert await trusting.get(2) == (200, PAGE)
    assert trusting.connections_opened == 1
    trusting.close()
    with pytest.raises(FetchFailure) as failure:  # a client that does not trust the certificate
        await KeepAliveGetter("localhost", server.port, "/metrics", ssl_context=ssl.create_default_context()).get(2)
    assert failure.value.reason == "connect"


async def test_a_chunked_answer_with_trailers_is_joined(serve):
    server = await serve(lambda n: (chunked(trailers="X-Done: 1\r\n"), "keep"))
    client = getter(server)
    assert await client.get(2) == (200, PAGE)
    assert await client.get(2) == (200, PAGE)
    assert client.connections_opened == 1
    client.close()


async def test_connection_close_and_read_until_close_answers_open_a_new_connection_next_time(serve):
    answers = [with_length(extra="Connection: close\r\n"), b"HTTP/1.0 200 OK\r\n\r\n" + PAGE]
    server = await serve(lambda n: (answers.pop(0), "close"))
    client = getter(server)
    assert await client.get(2) == (200, PAGE)
    assert await client.get(2) == (200, PAGE)
    assert server.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_replaced(serve):
    server = await serve(lambda n: (with_length(), "close"))  # the server closes after each answer
    client = getter(server)
    assert await client.get(2) == (200, PAGE)
    await asyncio.sleep(0.05)
    assert await client.get(2) == (200, PAGE)
    assert client.connections_opened == 2


async def test_a_kept_alive_connection_closed_under_a_request_is_retried_once_on_a_new_one(serve):
    # The second request reaches a connection the server drops without answering (its idle timeout).
    answers = [(with_length(), "keep"), (b"", "close"), (with_length(b"ok"), "keep")]
    server = await serve(lambda n: answers.pop(0))
    client = getter(server)
    assert await client.get(2) == (200, PAGE)
    assert await client.get(2) == (200, b"ok")
    assert client.connections_opened == server.connections == 2
    client.close()


async def test_a_fresh_connection_closed_without_an_answer_is_not_retried(serve):
    server = await serve(lambda n: (b"", "close"))
    client = getter(server)
    with pytest.raises(FetchFailure) as failure:
        await client.get(2)
    assert failure.value.reason == "protocol" and server.connections == 1


async def test_a_non_200_answer_is_returned_with_its_status(serve):
    server = await serve(lambda n: (b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy", "keep"))
    client = getter(server)
    assert await client.get(2) == (503, b"busy")
    client.close()


@pytest.mark.parametrize("answer,reason", [
    (with_length(b"x" * 5000), "too_large"),
    (chunked(b"x" * 5000), "too_large"),
    (b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 5000, "too_large"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "protocol"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "protocol"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "protocol"),
    (b"HTTP/1.1 100 Continue\r\n\r\n", "protocol"),
], ids=["length-over-limit", "chunks-over-limit", "until-close-over-limit", "not-http", "truncated",
        "bad-chunk-size", "interim"])
async def test_a_bad_answer_fails_with_its_reason_and_the_next_get_starts_clean(serve, answer, reason):
    answers = [(answer, "close"), (with_length(b"ok"), "keep")]
    server = await serve(lambda n: answers.pop(0) if answers else (with_length(b"ok"), "keep"))
    client = getter(server, max_body_bytes=4096)
    with pytest.raises(FetchFailure) as failure:
        await client.get(2)
    assert failure.value.reason == reason
    assert await client.get(2) == (200, b"ok")
    client.close()


async def test_no_answer_in_time_is_a_timeout_and_the_connection_is_not_reused(serve):
    answers = [(with_length(), "stall"), (with_length(b"ok"), "keep")]
    server = await serve(lambda n: answers.pop(0))
    client = getter(server)
    with pytest.raises(FetchFailure) as failure:
        await client.get(0.2)
    assert failure.value.reason == "timeout"
    assert await client.get(2) == (200, b"ok")
    assert client.connections_opened == 2
    client.close()


async def test_nothing_listening_is_a_connect_failure():
    [port] = free_ports(1)
    client = KeepAliveGetter("127.0.0.1", port, "/metrics")
    with pytest.raises(FetchFailure) as failure:
        await client.get(2)
    assert failure.value.reason == "connect"
