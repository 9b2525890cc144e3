"""Waiting for a condition in tests: poll it, and fail naming what did not happen in time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def wait_until(condition: Callable[[], Any], what: str = "the condition",
                     timeout: float = 5.0, interval: float = 0.01) -> Any:
    """Poll `condition` (sync or async) every `interval` s until it is truthy; return its value.

    Fails the test with "timed out after <timeout>s waiting for <what>" otherwise; the condition
    is checked once more after the deadline, so a late wake-up on a busy machine loses no chance.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def wait_until_blocking(condition: Callable[[], Any], what: str = "the condition",
                        timeout: float = 5.0, interval: float = 0.1) -> Any:
    """`wait_until` for code without an event loop (sync tests and fixtures driving subprocesses)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
