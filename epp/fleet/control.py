"""Puts vLLM replicas to sleep and wakes them (`POST /sleep`, `POST /wake_up`), and tells the registry."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from epp.datalayer.registry import EndpointRegistry
from epp.framework.types import Endpoint

log = logging.getLogger(__name__)


class ControlError(Exception):
    """A sleep or wake call that failed: refused, an error status, or no answer in time."""


class ReplicaControl:
    """HTTP calls to vLLM's sleep-mode routes (served with `VLLM_SERVER_DEV_MODE=1`).

    After a call succeeds the registry entry's `sleeping` flag is set at once, so the very next
    scheduling cycle sees it; the scraper confirms it from `vllm:engine_sleep_state` within one
    scrape interval.
    """

    def __init__(self, registry: EndpointRegistry, *, timeout: float = 30.0) -> None:
        self.registry = registry
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the HTTP session."""
        if self._session is None:
            self._session = aiohttp.ClientSession()

    async def stop(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def sleep(self, endpoint: Endpoint, level: int = 1) -> None:
        """`POST /sleep?level=N&mode=wait`; raises ControlError unless the replica says it sleeps.

        The replica is marked asleep before the call, so no request is routed to it while it goes
        down (vLLM's default mode aborts running requests; `mode=wait` lets them finish).
        """
        self._mark(endpoint, sleeping=True)
        try:
            answer = await self._post(endpoint, f"/sleep?level={level}&mode=wait", self.timeout)
            if isinstance(answer, dict) and answer.get("status") not in (None, "sleeping"):
                raise ControlError(f"{endpoint.name} answered /sleep with {answer!r}")
        except ControlError:
            self._mark(endpoint, sleeping=False)
            raise

    async def wake(self, endpoint: Endpoint, timeout: float | None = None) -> None:
        """`POST /wake_up`; vLLM answers once the weights are back. Raises ControlError otherwise."""
        answer = await self._post(endpoint, "/wake_up", timeout or self.timeout)
        if isinstance(answer, dict) and answer.get("status") == "sleeping":
            raise ControlError(f"{endpoint.name} is still sleeping after /wake_up")
        self._mark(endpoint, sleeping=False)

    async def _post(self, endpoint: Endpoint, path: str, timeout: float) -> object:
        if self._session is None:
            raise RuntimeError("ReplicaControl.start() was not called")
        url = f"http://{endpoint.hostport}{path}"
        try:
            async with asyncio.timeout(timeout):
                async with self._session.post(url, allow_redirects=False) as response:
                    text = await response.text()
                    if response.status != 200:
                        raise ControlError(f"{endpoint.name} answered {path} with HTTP {response.status}: "
                                           f"{text[:200]}")
                    try:
                        return await response.json(content_type=None)
                    except ValueError:
                        return None
        except TimeoutError:
            raise ControlError(f"{endpoint.name} did not answer {path} within {timeout:g}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ControlError(f"{endpoint.name}: {path} failed: {type(exc).__name__}: {exc}") from None

    def _mark(self, endpoint: Endpoint, *, sleeping: bool) -> None:
        # Held until a scrape shows it: a page fetched before the call must not undo it.
        self.registry.expect_sleeping(endpoint.name, sleeping, self.timeout)
        log.info("%s is %s", endpoint.name, "asleep" if sleeping else "awake")
