"""`epp engine pd-sidecar`: the decode pod's front door for prefill/decode disaggregation.

It listens on the pod's port and forwards to the local vLLM. A completions or chat request that
carries `x-prefiller-host-port` (set by the picker's prefill-header-handler; Envoy and the picker
remove any client copy) runs in two legs, as vLLM's NixlConnector expects:
1. prefill: the request goes to the prefiller with `kv_transfer_params` `do_remote_decode: true`,
   `stream: false` and one output token; the prefiller answers with the parameters to pull its KV;
2. decode: the original request (its own stream and token limits) goes to the local vLLM with those
   `kv_transfer_params`; the answer streams back to the client unchanged.
Two more headers the picker sets (llm-d's): `x-encoder-hosts-ports` (E/PD: before anything else,
each distinct image, audio or video item of a chat request goes to the encoders named, round
robin, as a one-token chat request of that item alone, so their encoder caches hold it; any
encoder failure is a 502) and `x-kv-cache-source-host-port` (a peer holding more of the prompt's
KV: the leg that computes the prompt, the prefill leg or else the local decode, gets
`kv_transfer_params.remote_kv_source` {kv_request_id, remote_host, remote_port: the peer's P2P
connector port: `x-kv-cache-source-p2p-port` when the picker sends it (p2p-source-producer's
`p2pPortBase`), else `--p2p-connector-port`} so the engine pulls those blocks instead of recomputing
them; a malformed or disallowed value, or the sidecar's own pod, is ignored).
Failures: a prefill leg that cannot be reached, times out, answers 408/429/5xx or without transfer
parameters falls back to a local prefill (nothing has reached the client yet, so this is safe;
`x-pd-fallback` says why); a prefill answer 4xx is the client's error and is returned as is; a
prefiller outside `--allowed-prefillers` is refused (403), a malformed header is a 400; a local vLLM
that cannot be reached is a 503 in vLLM's error shape. Requests without the header, and every
other path (`/metrics`, `/health`, ...), pass through untouched.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import ipaddress
import json
import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from epp.framework.headers import (
    ENCODER_HOSTS_PORTS_HEADER,
    KV_CACHE_SOURCE_HEADER,
    KV_CACHE_SOURCE_P2P_PORT_HEADER,
    PREFILLER_HOST_PORT_HEADER,
)

log = logging.getLogger("epp.pd_sidecar")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
USED_PREFILLER_HEADER = "x-pd-prefiller"  # on the answer: the prefiller whose KV was used
FALLBACK_HEADER = "x-pd-fallback"         # on the answer: why the prompt was prefilled locally
STATS_PATH = "/pd-sidecar/metrics"
# Hop-by-hop headers (RFC 9110 §7.6.1) and those the proxy recomputes are never forwarded.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                          "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
_RETRYABLE_STATUS = frozenset({408, 429})
# Routing headers the picker sets for this sidecar: read here, never forwarded to an engine.
_ROUTING_HEADERS = frozenset({PREFILLER_HOST_PORT_HEADER, ENCODER_HOSTS_PORTS_HEADER, KV_CACHE_SOURCE_HEADER,
                              KV_CACHE_SOURCE_P2P_PORT_HEADER})
# Chat content blocks an encoder computes (llm-d's E/PD): one encoder request per distinct item.
MULTIMODAL_TYPES = frozenset({"image_url", "audio_url", "video_url", "input_audio"})
# llm-d's OffloadingConnector P2P tier listens here on every pod unless configured otherwise.
DEFAULT_P2P_CONNECTOR_PORT = 7777


@dataclass(frozen=True)
class SidecarConfig:
    """Where the sidecar listens, the local vLLM it fronts, and its P/D policy."""

    host: str = "0.0.0.0"
    port: int = 8000
    vllm_host: str = "127.0.0.1"
    vllm_port: int = 8001
    connector: str = "nixl"
    prefill_timeout_s: float = 60.0
    # Networks a prefiller may be in (empty: any). The header comes from the picker; this guards
    # against anything else reaching the pod's port and aiming the prefill leg elsewhere.
    allowed_prefillers: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    fallback_to_local: bool = True
    encoder_timeout_s: float = 60.0
    # The port of the engines' P2P KV connector (a KV source is pulled from there), and this pod's
    # own address (`POD_IP`): a KV source that is this pod itself is ignored.
    p2p_connector_port: int = DEFAULT_P2P_CONNECTOR_PORT
    self_host: str | None = None

    @property
    def vllm_base(self) -> str:
        host = f"[{self.vllm_host}]" if ":" in self.vllm_host else self.vllm_host
        return f"http://{host}:{self.vllm_port}"


class LegError(Exception):
    """One leg failed; `status` and `message` are the client's answer when no fallback applies."""

    def __init__(self, status: int, message: str, *, fallback: bool) -> None:
        super().__init__(message)
        self.status, self.message, self.fallback = status, message, fallback


def error_response(status: int, message: str, err_type: str = "BadGateway") -> web.Response:
    """An error in vLLM's JSON shape."""
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.json_response(body, status=status)


def parse_prefiller(value: str, header: str = PREFILLER_HOST_PORT_HEADER) -> tuple[str, int]:
    """`ip:port` or `[ipv6]:port` from the header; raises ValueError when it is anything else."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{header} must be ip:port, got {value!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(host)  # an address, not a name: nothing to resolve, nothing to spoof
    except ValueError:
        raise ValueError(f"{header} must be ip:port with an IP address, got {value!r}") from None
    return host, int(port)


def multimodal_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The distinct multimodal content blocks of a chat request's messages (a URL sent twice counts once)."""
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if not isinstance(block, dict) or block.get("type") not in MULTIMODAL_TYPES:
                continue
            inner = block.get(block["type"])
            url = inner.get("url") if isinstance(inner, dict) else None
            if isinstance(url, str):
                if url in seen:
                    continue
                seen.add(url)
            items.append(block)
    return items


def _same_address(host: str, other: str | None) -> bool:
    try:
        return other is not None and ipaddress.ip_address(host) == ipaddress.ip_address(other)
    except ValueError:
        return False


def _one_token(leg: dict[str, Any]) -> dict[str, Any]:
    """A leg's request (a copy of the client's) made to answer one token, not streamed."""
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return leg


def encoder_body(body: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
    """One encoder request: the chat request with this item alone as its user message, one output token."""
    leg = copy.copy(body)
    leg["messages"] = [{"role": "user", "content": [item]}]
    return _one_token(leg)


def _p2p_port(value: str | None, default: int) -> int:
    """The P2P port the picker named for the KV source (`x-kv-cache-source-p2p-port`), else `default`."""
    if value is None:
        return default
    value = value.strip()
    if value.isascii() and value.isdigit() and 0 < int(value) < 65536:
        return int(value)
    log.info("ignoring %s %r: not a port", KV_CACHE_SOURCE_P2P_PORT_HEADER, value[:32])
    return default


def kv_source_params(host: str, p2p_port: int) -> dict[str, Any]:
    """`kv_transfer_params.remote_kv_source`: pull the prompt's blocks from this peer's P2P connector."""
    return {"kv_request_id": str(uuid.uuid4()), "remote_host": host, "remote_port": p2p_port}


def prefill_body(body: dict[str, Any], kv_source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The prefill leg's request: one token, not streamed, asking the prefiller to keep its KV."""
    leg = copy.copy(body)
    leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    if kv_source is not None:
        leg["kv_transfer_params"]["remote_kv_source"] = kv_source
    return _one_token(leg)


def _forward_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items()
            if k.lower() not in _HOP_HEADERS and k.lower() not in _ROUTING_HEADERS}


class PDSidecar:
    """The aiohttp server of the decode-side sidecar."""

    def __init__(self, config: SidecarConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("pd_sidecar_requests", "Generation requests by path taken: disaggregated, "
                                "local (no prefiller header), fallback (prefill leg failed), error",
                                ["outcome"], registry=self.registry)
        self.leg_seconds = Counter("pd_sidecar_prefill_leg_seconds", "Time spent in prefill legs",
                                   registry=self.registry)
        self.encoder_items = Counter("pd_sidecar_encoder_items", "Multimodal items sent to encoders (E/PD), by "
                                     "outcome: ok, error", ["outcome"], registry=self.registry)
        self.kv_pulls = Counter("pd_sidecar_kv_source_pulls", "Requests sent with a P2P KV source to pull from, by "
                                "leg: prefill, decode", ["leg"], registry=self.registry)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.bound_port = config.port

    # -- lifecycle ---------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get(STATS_PATH, self._stats)
        for path in GENERATION_PATHS:
            app.router.add_post(path, self._generate)
        app.router.add_route("*", "/{tail:.*}", self._passthrough)
        return app

    async def start(self) -> None:
        """Bind the port (0: a free one, see `bound_port`)."""
        # No total timeout on the session: a decode stream lasts as long as it lasts.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                              auto_decompress=False)
        self._runner = web.AppRunner(self.build_app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        await site.start()
        self.bound_port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "start() first"
        return self._session

    # -- routes ------------------------------------------------------------------------------
    async def _stats(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return await self._to_vllm(request, request.method, body, extra_headers={})

    def _allowed(self, host: str) -> bool:
        nets = self.config.allowed_prefillers
        return not nets or any(ipaddress.ip_address(host) in net for net in nets)

    def _kv_source(self, value: str | None, computing: tuple[str, int] | None,
                   p2p_port: str | None = None) -> dict[str, Any] | None:
        """The pull parameters of a usable `x-kv-cache-source-host-port`, else None (malformed ones are ignored).

        `p2p_port` is the picker's `x-kv-cache-source-p2p-port`; a malformed one leaves `--p2p-connector-port`."""
        if not value:
            return None
        try:
            host, port = parse_prefiller(value, KV_CACHE_SOURCE_HEADER)
        except ValueError as exc:
            log.info("ignoring %s", exc)
            return None
        if not self._allowed(host):
            log.info("ignoring KV cache source %s outside --allowed-prefillers", value)
            return None
        if computing is not None and (host, port) == computing:
            return None
        if computing is None and port == self.config.port and _same_address(host, self.config.self_host):
            return None  # this pod itself
        return kv_source_params(host, _p2p_port(p2p_port, self.config.p2p_connector_port))

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        header = request.headers.get(PREFILLER_HOST_PORT_HEADER)
        encoders = request.headers.get(ENCODER_HOSTS_PORTS_HEADER)
        source = request.headers.get(KV_CACHE_SOURCE_HEADER)
        source_port = request.headers.get(KV_CACHE_SOURCE_P2P_PORT_HEADER)
        if header is None and encoders is None and source is None:
            self.requests.labels("local").inc()
            return await self._to_vllm(request, "POST", raw, extra_headers={})
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError:
            # Not JSON: the local vLLM answers with its own 400; no prefill to split off.
            self.requests.labels("local").inc()
            return await self._to_vllm(request, "POST", raw, extra_headers={})
        if encoders is not None and request.path == "/v1/chat/completions":
            failure = await self._encode(request, encoders, body)
            if failure is not None:
                self.requests.labels("error").inc()
                return failure
        if header is None:
            pull = self._kv_source(source, None, source_port)
            self.requests.labels("local").inc()
            if pull is None:
                return await self._to_vllm(request, "POST", raw, extra_headers={})
            # The sidecar owns kv_transfer_params: a client's own keys never reach the engine.
            self.kv_pulls.labels("decode").inc()
            local = {**body, "kv_transfer_params": {"remote_kv_source": pull}}
            return await self._to_vllm(request, "POST", json.dumps(local).encode(), extra_headers={})
        try:
            host, port = parse_prefiller(header)
        except ValueError as exc:
            self.requests.labels("error").inc()
            return error_response(400, str(exc), "BadRequestError")
        if not self._allowed(host):
            self.requests.labels("error").inc()
            return error_response(403, f"prefiller {header} is outside --allowed-prefillers", "Forbidden")
        pull = self._kv_source(source, (host, port), source_port)
        if pull is not None:
            self.kv_pulls.labels("prefill").inc()
        try:
            params = await self._prefill(request, host, port, body, pull)
        except LegError as exc:
            if not (exc.fallback and self.config.fallback_to_local):
                self.requests.labels("error").inc()
                return error_response(exc.status, exc.message)
            log.warning("prefill leg on %s failed (%s); prefilling locally", header, exc.message)
            self.requests.labels("fallback").inc()
            return await self._to_vllm(request, "POST", raw, extra_headers={FALLBACK_HEADER: exc.message[:200]})
        decode = dict(body)
        decode["kv_transfer_params"] = params
        self.requests.labels("disaggregated").inc()
        return await self._to_vllm(request, "POST", json.dumps(decode).encode(),
                                   extra_headers={USED_PREFILLER_HEADER: header})

    # -- legs --------------------------------------------------------------------------------
    async def _encode(self, request: web.Request, header: str, body: dict[str, Any]) -> web.Response | None:
        """Send each multimodal item to the encoders (round robin, at once); an error answer, or None when done."""
        try:
            hosts = [parse_prefiller(part, ENCODER_HOSTS_PORTS_HEADER) for part in header.split(",") if part.strip()]
            if not hosts:
                raise ValueError(f"{ENCODER_HOSTS_PORTS_HEADER} names no encoder")
        except ValueError as exc:
            return error_response(400, str(exc), "BadRequestError")
        for host, _ in hosts:
            if not self._allowed(host):
                return error_response(403, f"encoder {host} is outside --allowed-prefillers", "Forbidden")
        items = multimodal_items(body)
        if not items:
            return None
        headers = {k: v for k, v in _forward_headers(request.headers).items()
                   if k.lower() not in ("content-type", "accept-encoding")}
        headers["content-type"] = "application/json"

        async def one(i: int, item: dict[str, Any]) -> str | None:
            host, port = hosts[i % len(hosts)]
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}{request.path}"
            try:
                async with self.session.post(url, data=json.dumps(encoder_body(body, item)).encode(), headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=self.config.encoder_timeout_s)) as r:
                    await r.read()
                    if r.status >= 400:
                        return f"encoder {host}:{port} answered {r.status}"
            except (TimeoutError, aiohttp.ClientError) as exc:
                return f"encoder {host}:{port} failed: {exc.__class__.__name__}"
            return None

        failures = [f for f in await asyncio.gather(*(one(i, item) for i, item in enumerate(items))) if f]
        self.encoder_items.labels("ok").inc(len(items) - len(failures))
        if failures:
            self.encoder_items.labels("error").inc(len(failures))
            return error_response(502, f"encoding the request's multimodal items failed: {failures[0]}")
        return None

    async def _prefill(self, request: web.Request, host: str, port: int, body: dict[str, Any],
                       kv_source: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run the prefill leg; the prefiller's `kv_transfer_params`, or LegError."""
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}{request.path}"
        headers = {k: v for k, v in _forward_headers(request.headers).items()
                   if k.lower() not in ("content-type", "accept-encoding")}
        headers["content-type"] = "application/json"
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with self.session.post(url, data=json.dumps(prefill_body(body, kv_source)).encode(), headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.config.prefill_timeout_s)) as resp:
                payload = await resp.read()
                status = resp.status
        except TimeoutError:
            raise LegError(504, f"prefill leg to {host}:{port} timed out after {self.config.prefill_timeout_s:g}s",
                           fallback=True) from None
        except aiohttp.ClientError as exc:
            raise LegError(502, f"prefill leg to {host}:{port} failed: {exc.__class__.__name__}: {exc}",
                           fallback=True) from None
        finally:
            self.leg_seconds.inc(loop.time() - started)
        if status >= 500 or status in _RETRYABLE_STATUS:
            raise LegError(502, f"prefill leg to {host}:{port} answered {status}", fallback=True)
        if status >= 400:
            raise LegError(status, f"prefill leg to {host}:{port} refused the request ({status}): "
                                   f"{payload[:500].decode('utf-8', 'replace')}", fallback=False)
        try:
            params = json.loads(payload).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            raise LegError(502, f"prefill leg to {host}:{port} returned no kv_transfer_params "
                                "(is its vLLM started with a KV connector?)", fallback=True)
        return params

    async def _to_vllm(self, request: web.Request, method: str, body: bytes,
                       extra_headers: dict[str, str]) -> web.StreamResponse:
        """Send to the local vLLM and stream its answer back as it comes."""
        url = self.config.vllm_base + request.rel_url.path_qs
        headers = _forward_headers(request.headers)
        try:
            upstream = await self.session.request(method, url, data=body, headers=headers)
        except aiohttp.ClientError as exc:
            return error_response(503, f"local vLLM at {self.config.vllm_base} unreachable: "
                                       f"{exc.__class__.__name__}", "ServiceUnavailableError")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP_HEADERS:
                    response.headers.add(key, value)
            response.headers.update(extra_headers)
            await response.prepare(request)
            try:
                async for piece in upstream.content.iter_any():
                    await response.write(piece)
            except aiohttp.ClientError as exc:
                # The decode engine died mid-answer: the client sees a cut stream, and we say why in the log.
                log.warning("local vLLM answer cut short: %s", exc)
                return response
            await response.write_eof()
            return response


def _networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    try:
        return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of networks: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    """The flags of `epp engine pd-sidecar`."""
    p = argparse.ArgumentParser(
        prog="epp engine pd-sidecar",
        description="Front a decode vLLM for P/D disaggregation: with x-prefiller-host-port, prefill there "
                    "(NIXL KV transfer), then decode locally; without, pass through.")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="the pod's port, which the picker routes to (default 8000)")
    p.add_argument("--vllm-host", default="127.0.0.1", help="the local vLLM's address (default 127.0.0.1)")
    p.add_argument("--vllm-port", type=int, default=8001, help="the local vLLM's port (default 8001)")
    p.add_argument("--connector", default="nixl", choices=["nixl"],
                   help="KV transfer protocol of the prefill leg (default nixl: vLLM's NixlConnector)")
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds the prefill leg may take before a local prefill (default 60)")
    p.add_argument("--allowed-prefillers", type=_networks, default=(),
                   help="comma list of networks prefillers may be in, e.g. 10.0.0.0/8 (default: any)")
    p.add_argument("--p2p-connector-port", type=int,
                   default=int(os.environ.get("P2P_CONNECTOR_PORT", DEFAULT_P2P_CONNECTOR_PORT)),
                   help="the engines' P2P KV connector port, where a KV source is pulled from unless the "
                        "picker names the source's own (x-kv-cache-source-p2p-port) (default 7777, "
                        "or $P2P_CONNECTOR_PORT)")
    p.add_argument("--no-fallback", dest="fallback", action="store_false",
                   help="answer 502/504 when the prefill leg fails instead of prefilling locally")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs")
    return p


async def _serve(config: SidecarConfig) -> None:
    sidecar = PDSidecar(config)
    await sidecar.start()
    print(f"epp engine pd-sidecar: on {config.host}:{sidecar.bound_port}, local vLLM {config.vllm_base}, "
          f"connector {config.connector}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await sidecar.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sidecar until SIGTERM; 2 on unusable options."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2))
    if args.port == args.vllm_port and args.vllm_host in ("127.0.0.1", "localhost", args.host):
        print("epp engine pd-sidecar: --port and --vllm-port must differ (the sidecar fronts vLLM)", file=sys.stderr)
        return 2
    if args.prefill_timeout <= 0:
        print("epp engine pd-sidecar: --prefill-timeout must be positive", file=sys.stderr)
        return 2
    config = SidecarConfig(host=args.host, port=args.port, vllm_host=args.vllm_host, vllm_port=args.vllm_port,
                           connector=args.connector, prefill_timeout_s=args.prefill_timeout,
                           allowed_prefillers=args.allowed_prefillers, fallback_to_local=args.fallback,
                           p2p_connector_port=args.p2p_connector_port, self_host=os.environ.get("POD_IP") or None)
    try:
        asyncio.run(_serve(config))
    except OSError as exc:
        print(f"epp engine pd-sidecar: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
