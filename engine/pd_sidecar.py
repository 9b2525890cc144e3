"""`epp engine pd-sidecar`: the decode pod's front door for prefill/decode disaggregation.

It listens on the pod's port and forwards to the local vLLM. A completions or chat request that
carries `x-prefiller-host-port` (set by the picker's prefill-header-handler; Envoy and the picker
remove any client copy) runs in two legs, as vLLM's NixlConnector expects:
1. prefill: the request goes to the prefiller with `kv_transfer_params` `do_remote_decode: true`,
   `stream: false` and one output token; the prefiller answers with the parameters to pull its KV;
2. decode: the original request (its own stream and token limits) goes to the local vLLM with those
   `kv_transfer_params`; the answer streams back to the client unchanged.
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
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from epp.framework.headers import PREFILLER_HOST_PORT_HEADER

log = logging.getLogger("epp.pd_sidecar")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
USED_PREFILLER_HEADER = "x-pd-prefiller"  # on the answer: the prefiller whose KV was used
FALLBACK_HEADER = "x-pd-fallback"         # on the answer: why the prompt was prefilled locally
STATS_PATH = "/pd-sidecar/metrics"
# Hop-by-hop headers (RFC 9110 §7.6.1) and those the proxy recomputes are never forwarded.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                          "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
_RETRYABLE_STATUS = frozenset({408, 429})


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


def parse_prefiller(value: str) -> tuple[str, int]:
    """`ip:port` or `[ipv6]:port` from the header; raises ValueError when it is anything else."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{PREFILLER_HOST_PORT_HEADER} must be ip:port, got {value!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(host)  # an address, not a name: nothing to resolve, nothing to spoof
    except ValueError:
        raise ValueError(f"{PREFILLER_HOST_PORT_HEADER} must be ip:port with an IP address, got {value!r}") from None
    return host, int(port)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's request: one token, not streamed, asking the prefiller to keep its KV."""
    leg = copy.copy(body)
    leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return leg


def _forward_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items()
            if k.lower() not in _HOP_HEADERS and k.lower() != PREFILLER_HOST_PORT_HEADER}


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

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        header = request.headers.get(PREFILLER_HOST_PORT_HEADER)
        if header is None:
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
        try:
            host, port = parse_prefiller(header)
        except ValueError as exc:
            self.requests.labels("error").inc()
            return error_response(400, str(exc), "BadRequestError")
        if self.config.allowed_prefillers and not any(
                ipaddress.ip_address(host) in net for net in self.config.allowed_prefillers):
            self.requests.labels("error").inc()
            return error_response(403, f"prefiller {header} is outside --allowed-prefillers", "Forbidden")
        try:
            params = await self._prefill(request, host, port, body)
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
    async def _prefill(self, request: web.Request, host: str, port: int, body: dict[str, Any]) -> dict[str, Any]:
        """Run the prefill leg; the prefiller's `kv_transfer_params`, or LegError."""
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}{request.path}"
        headers = {k: v for k, v in _forward_headers(request.headers).items()
                   if k.lower() not in ("content-type", "accept-encoding")}
        headers["content-type"] = "application/json"
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with self.session.post(url, data=json.dumps(prefill_body(body)).encode(), headers=headers,
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
                           allowed_prefillers=args.allowed_prefillers, fallback_to_local=args.fallback)
    try:
        asyncio.run(_serve(config))
    except OSError as exc:
        print(f"epp engine pd-sidecar: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
