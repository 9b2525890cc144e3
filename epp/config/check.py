"""`epp check-config FILE`: validate a config and print the resolved pipeline."""

from __future__ import annotations

import sys

from epp.config.describe import describe
from epp.config.loader import load_config
from epp.framework.errors import ConfigError


def check_config_main(path: str) -> int:
    """Print the resolved pipeline of `path` (exit code 0) or the configuration error (exit code 1)."""
    try:
        loaded = load_config(path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(describe(loaded))
    return 0
