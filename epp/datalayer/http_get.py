"""A lean HTTP/1.1 GET over one kept-alive connection: the `/metrics` scrape's transport.

A picker scrapes every replica 20 times a second (GIE's 50 ms). On loopback, aiohttp's client
costs ~135 µs of CPU per GET of a 38 KB page and this protocol ~55 µs (`bench/scrape_bench.py`
has the end-to-end numbers); at the default scrape budget that is most of a core. It speaks only
what a scrape needs: GET with a fixed request, a `Content-Length`, chunked or read-until-close
body, keep-alive with one retry when a reused connection turns out closed, TLS when asked.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

MAX_HEAD_BYTES = 64 * 1024


class FetchFailure(Exception):
    """A GET that gave no usable answer; `reason` is a metric label (connect, timeout, too_large, protocol)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class _ResponseReader(asyncio.Protocol):
    """Parses one response at a time from the connection's bytes; `done` resolves with it."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.done: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.received_any = False
        self._buffer = bytearray()
        self._status = 0
        self._keep_alive = True
        self._length: int | None = None  # the body's Content-Length, if it has one
        self._chunked = False
        self._until_close = False
        self._in_body = False
        self._parts: list[bytes] = []
        self._size = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is None or self.done.done():
            return
        if self._until_close and self._in_body:
            self._finish(keep_alive=False)
        else:
            self._fail(FetchFailure("protocol", "connection closed before the response ended"))

    def expect(self, done: asyncio.Future[tuple[int, bytes, bool]]) -> None:
        """Start reading the answer to a request just sent."""
        self.done = done
        self.received_any = False
        self._buffer.clear()
        self._in_body = self._chunked = self._until_close = False
        self._length = None
        self._parts = []
        self._size = 0

    def data_received(self, data: bytes) -> None:
        if self.done is None or self.done.done():
            self._fail(FetchFailure("protocol", "bytes outside a response"))
            return
        self.received_any = True
        try:
            if self._in_body and not self._chunked and not self._buffer:
                self._body_bytes(data)  # the common case: body bytes straight into the parts
            else:
                self._buffer += data
                self._parse()
        except FetchFailure as failure:
            self._fail(failure)

    def _parse(self) -> None:
        if not self._in_body:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    raise FetchFailure("protocol", "response head too large")
                return
            self._head(bytes(self._buffer[:end]))
            del self._buffer[:end + 4]
            if self._length == 0:
                self._finish(self._keep_alive)
                return
        if self._chunked:
            self._chunks()
        elif self._buffer:
            data = bytes(self._buffer)
            self._buffer.clear()
            self._body_bytes(data)

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise FetchFailure("protocol", f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self._status = int(parts[1])
        if self._status < 200:
            raise FetchFailure("protocol", f"interim response {self._status} to a GET")
        self._keep_alive = parts[0] == b"HTTP/1.1"
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == b"content-length":
                if not value.isdigit():
                    raise FetchFailure("protocol", "bad Content-Length")
                length = int(value)
            elif name == b"transfer-encoding":
                self._chunked = value.endswith(b"chunked")
            elif name == b"connection":
                self._keep_alive = value == b"keep-alive" or (self._keep_alive and value != b"close")
        self._in_body = True
        if self._status in (204, 304):
            self._chunked, self._length = False, 0  # no body by definition
        elif self._chunked:
            return
        elif length is None:
            self._until_close = True
            self._keep_alive = False
        elif length > self.max_body_bytes:
            raise FetchFailure("too_large", f"{length} bytes")
        else:
            self._length = length

    def _body_bytes(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self.max_body_bytes:
            raise FetchFailure("too_large", f"over {self.max_body_bytes} bytes")
        if self._length is not None and self._size > self._length:
            raise FetchFailure("protocol", "more bytes than Content-Length")
        self._parts.append(data)
        if self._length is not None and self._size == self._length:
            self._finish(self._keep_alive)

    def _chunks(self) -> None:
        buf = self._buffer
        while True:
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                if len(buf) > 1024:
                    raise FetchFailure("protocol", "bad chunk size line")
                return
            size_text = bytes(buf[:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise FetchFailure("protocol", f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                # The last chunk, then optional trailers, then an empty line.
                if buf.find(b"\r\n\r\n", line_end) < 0:
                    return
                self._finish(self._keep_alive)
                return
            if len(buf) < line_end + 2 + size + 2:
                if self._size + size > self.max_body_bytes:
                    raise FetchFailure("too_large", f"over {self.max_body_bytes} bytes")
                return
            self._body_bytes(bytes(buf[line_end + 2:line_end + 2 + size]))
            del buf[:line_end + 2 + size + 2]

    def _finish(self, keep_alive: bool) -> None:
        assert self.done is not None
        body = b"".join(self._parts)
        self._parts = []
        self._in_body = False
        self.done.set_result((self._status, body, keep_alive))

    def _fail(self, failure: FetchFailure) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(failure)
        if self.transport is not None:
            self.transport.close()  # the stream's framing is lost: never reuse it


class KeepAliveGetter:
    """GETs of one URL path from one host:port over a connection kept open between calls."""

    def __init__(self, host: str, port: int, path: str, *, ssl_context: ssl.SSLContext | None = None,
                 max_body_bytes: int = 4 * 1024 * 1024) -> None:
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self.max_body_bytes = max_body_bytes
        host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # Compressing a page on loopback or a pod network costs more CPU than it saves.
        self._request = (f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nAccept-Encoding: identity\r\n"
                         "User-Agent: epp-scraper\r\n\r\n").encode("ascii")
        self._reader: _ResponseReader | None = None
        self.connections_opened = 0

    async def get(self, timeout: float) -> tuple[int, bytes]:
        """Status and body of one GET, within `timeout` seconds; raises `FetchFailure`."""
        try:
            async with asyncio.timeout(timeout):
                return await self._get()
        except TimeoutError:
            self.close()  # an answer may still come: this connection cannot be reused
            raise FetchFailure("timeout", f"no answer within {timeout}s") from None

    async def _get(self) -> tuple[int, bytes]:
        reused = self._reader is not None and not self._reader.closed
        reader = await self._connection()
        try:
            return await self._exchange(reader)
        except FetchFailure:
            # A kept-alive connection the server closed while idle: one retry on a fresh one.
            if not reused or reader.received_any or not reader.closed:
                raise
        return await self._exchange(await self._connection())

    async def _exchange(self, reader: _ResponseReader) -> tuple[int, bytes]:
        done: asyncio.Future[tuple[int, bytes, bool]] = asyncio.get_running_loop().create_future()
        reader.expect(done)
        assert reader.transport is not None
        reader.transport.write(self._request)
        try:
            status, body, keep_alive = await done
        except BaseException:
            self.close()
            raise
        if not keep_alive:
            self.close()
        return status, body

    async def _connection(self) -> _ResponseReader:
        if self._reader is not None and not self._reader.closed:
            return self._reader
        loop = asyncio.get_running_loop()
        kwargs: dict[str, Any] = {}
        if self.ssl_context is not None:
            kwargs = {"ssl": self.ssl_context, "server_hostname": self.host}
        try:
            _, reader = await loop.create_connection(lambda: _ResponseReader(self.max_body_bytes),
                                                     self.host, self.port, **kwargs)
        except OSError as exc:  # refused, unreachable, or a TLS handshake that failed
            raise FetchFailure("connect", f"{type(exc).__name__}: {exc}") from None
        self.connections_opened += 1
        self._reader = reader
        return reader

    def close(self) -> None:
        """Close the connection (the next `get` opens a new one)."""
        if self._reader is not None and self._reader.transport is not None:
            self._reader.transport.close()
        self._reader = None


__all__ = ["FetchFailure", "KeepAliveGetter", "MAX_HEAD_BYTES"]
