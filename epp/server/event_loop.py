"""The event loop a serving process runs on: uvloop when installed, else plain asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_event_loop(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` to completion on uvloop when it is installed (cheaper I/O on the hot path), else asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)
