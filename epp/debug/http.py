"""The metrics port's HTTP server: Prometheus' `/metrics`, and the `/debug` routes when enabled.

It runs in its own threads (as `prometheus_client.start_http_server` does), so a scrape never
waits for the event loop. The `/debug` routes read plugin state that only the event loop
changes, so their work is handed to the loop (`run_coroutine_threadsafe`) and the thread waits
for it; the JSON is written back on the thread. With the debug endpoint off every `/debug` path
answers 404 with how to turn it on.

- `GET /debug/state`: `epp.debug.state` (`?plugin=NAME`: that plugin's part alone);
- `POST /debug/explain`: `epp.debug.explain` (at most `MAX_EXPLAIN_BYTES` of request, one at a
  time: a second while one runs gets 429).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from epp.debug.explain import ExplainInput, parse_explain_input
from epp.debug.state import StateSnapshot, plugin_names, render_state
from epp.framework.errors import InferenceError
from epp.logutil import log_failure

log = logging.getLogger(__name__)

DEBUG_PREFIX = "/debug"
OFF_MESSAGE = "the debug endpoint is off; start epp serve with --enable-debug-endpoint"
MAX_EXPLAIN_BYTES = 4 * 1024 * 1024
# How long a debug request waits for the event loop (a loop that long busy is itself the finding).
LOOP_TIMEOUT_S = 10.0

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass(frozen=True)
class DebugRoutes:
    """What the `/debug` routes run on the picker's event loop."""

    loop: asyncio.AbstractEventLoop
    collect_state: Callable[[], Awaitable[StateSnapshot]]
    explain: Callable[[ExplainInput], Awaitable[dict[str, Any]]]


def _json(start_response: Callable[..., Any], status: str, document: Any) -> list[bytes]:
    body = document if isinstance(document, bytes) else json.dumps(document, indent=1).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                            ("X-Content-Type-Options", "nosniff")])
    return [body]


def _error(start_response: Callable[..., Any], status: str, message: str) -> list[bytes]:
    return _json(start_response, status, {"error": message})


def _query_plugin(query: str) -> str | None:
    """The `plugin` named in a `/debug/state` query string (None: every plugin)."""
    values = parse_qs(query).get("plugin")
    return values[-1] if values else None


class _LoopUnavailable(Exception):
    """The event loop cannot run a debug request now (stopped, or too busy to answer in time)."""


class _Failed(Exception):
    """A debug request failed inside the picker (the error is logged)."""


class _DebugApp:
    def __init__(self, routes: DebugRoutes) -> None:
        self.routes = routes
        self._explaining = threading.Lock()

    def _on_loop(self, work: Awaitable[Any]) -> Any:
        """Run `work` on the event loop and wait for it here, on the server's thread."""
        coroutine = _awaited(work)
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self.routes.loop)
        except RuntimeError:  # the loop is closed
            coroutine.close()
            if asyncio.iscoroutine(work):
                work.close()
            raise _LoopUnavailable("the picker is shutting down") from None
        try:
            return future.result(LOOP_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise _LoopUnavailable(f"the picker's event loop did not answer within {LOOP_TIMEOUT_S:g}s") from None
        except InferenceError:
            raise
        except Exception as exc:  # a bug, not the request: logged (never its message: it may quote a prompt)
            log_failure(log, logging.ERROR, "debug request failed", exc)
            raise _Failed(f"the debug request failed: {type(exc).__name__} (logged)") from None

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if path == "/debug/state":
            if method != "GET":
                return _error(start_response, "405 Method Not Allowed", "use GET /debug/state")
            try:
                snapshot = self._on_loop(self.routes.collect_state())
            except _LoopUnavailable as exc:
                return _error(start_response, "503 Service Unavailable", str(exc))
            except _Failed as exc:
                return _error(start_response, "500 Internal Server Error", str(exc))
            plugin = _query_plugin(environ.get("QUERY_STRING", ""))
            if plugin is not None and plugin not in (names := plugin_names(snapshot)):
                return _error(start_response, "404 Not Found", f"no plugin named {plugin!r}; the plugins are {names}")
            return _json(start_response, "200 OK", render_state(snapshot, plugin))
        if path == "/debug/explain":
            if method != "POST":
                return _error(start_response, "405 Method Not Allowed", "use POST /debug/explain with a JSON body")
            return self._explain(environ, start_response)
        return _error(start_response, "404 Not Found",
                      f"no debug route {path!r}; there are GET /debug/state and POST /debug/explain")

    def _explain(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        length_text = environ.get("CONTENT_LENGTH") or ""
        if not length_text.isdigit():
            return _error(start_response, "411 Length Required", "send the explain request with a Content-Length")
        length = int(length_text)
        if length > MAX_EXPLAIN_BYTES:
            return _error(start_response, "413 Content Too Large",
                          f"the explain request is {length} bytes; the limit is {MAX_EXPLAIN_BYTES}")
        try:
            given = parse_explain_input(json.loads(environ["wsgi.input"].read(length)))
        except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
            return _error(start_response, "400 Bad Request", f"bad explain request: {exc}")
        if not self._explaining.acquire(blocking=False):
            return _error(start_response, "429 Too Many Requests", "another explain is running; try again")
        try:
            answer = self._on_loop(self.routes.explain(given))
        except InferenceError as exc:  # the request itself would be refused: say so as the picker would
            status = exc.code.http_status
            return _json(start_response, f"{status} {HTTPStatus(status).phrase}", {"error": exc.body})
        except _LoopUnavailable as exc:
            return _error(start_response, "503 Service Unavailable", str(exc))
        except _Failed as exc:
            return _error(start_response, "500 Internal Server Error", str(exc))
        finally:
            self._explaining.release()
        return _json(start_response, "200 OK", answer)


async def _awaited(work: Awaitable[Any]) -> Any:
    return await work


def metrics_app(registry: CollectorRegistry, debug: DebugRoutes | None) -> WsgiApp:
    """`/metrics` (any path but `/debug/...`, as Prometheus' own server), and the debug routes."""
    metrics = make_wsgi_app(registry)
    debug_app = _DebugApp(debug) if debug is not None else None

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == DEBUG_PREFIX or path.startswith(DEBUG_PREFIX + "/"):
            if debug_app is None:
                return _error(start_response, "404 Not Found", OFF_MESSAGE)
            return debug_app(environ, start_response)
        return metrics(environ, start_response)

    return app


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape on stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        return None


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that fails the TLS handshake (--metrics-cert-dir) or hangs up is no picker error:
        # no traceback on stderr for it.
        if isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


# How often the server thread looks for a shutdown request: `shutdown()` waits up to this long
# (the standard library's 0.5 s held every picker's stop that long).
POLL_INTERVAL_S = 0.05


def start_metrics_http(host: str, port: int, app: WsgiApp, ssl_context: ssl.SSLContext | None = None) -> WSGIServer:
    """Serve `app` on `host:port` from a daemon thread (over TLS with `ssl_context`); `shutdown()` and
    `server_close()` stop it."""

    class Server(_ThreadingServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = make_server(host, port, app, Server, handler_class=_QuietHandler)
    if ssl_context is not None:
        # The handshake happens on the request's own thread (first read), not in accept(): a slow
        # client cannot hold up the others.
        server.socket = ssl_context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL_INTERVAL_S},
                     name="epp-metrics-http", daemon=True).start()
    return server
