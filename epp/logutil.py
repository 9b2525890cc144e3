"""Logging that hostile input cannot turn into noise or a leak: one line per kind, no request content.

At the default level (WARNING) the picker logs what failed and where, never an exception's message
or traceback: those can quote a prompt (a UnicodeEncodeError carries the whole string it failed on).
The full detail is logged at DEBUG.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
import traceback

# The text log line of `epp` commands.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# zap's level names, which log collectors set up for the llm-d EPP (`--zap-encoder json`) expect.
_ZAP_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error",
              logging.CRITICAL: "panic"}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per log line (`--zap-encoder json`): level, ts (ISO 8601, UTC), logger, msg, and
    error (the traceback) when one is attached."""

    def __init__(self, fields: dict[str, str] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})  # constant fields every line carries (a worker's index)

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        line: dict[str, object] = {
            "level": _ZAP_NAMES.get(record.levelno, record.levelname.lower()),
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "logger": record.name, "msg": record.getMessage(), **self.fields}
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def describe(exc: BaseException) -> str:
    """`TypeName at file.py:line in function`, naming where it was raised, without its message."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    return f"{type(exc).__name__} at {last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name}"


def log_failure(logger: logging.Logger, level: int, message: str, exc: BaseException, *args: object) -> None:
    """Log `message % args` with `describe(exc)` at `level`, and the traceback only at DEBUG."""
    logger.log(level, message + ": %s", *args, describe(exc))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("detail of the failure above", exc_info=exc)


class Throttled:
    """Logs a kind of event at most once per `every` seconds, with how many were not logged."""

    def __init__(self, logger: logging.Logger, every: float = 60.0) -> None:
        self.logger = logger
        self.every = every
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, kind: str, message: str, *args: object) -> None:
        """Log `message % args` unless `kind` was logged less than `every` seconds ago."""
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.every:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            message += " (%d more like this since the last such line)"
            args = (*args, suppressed)
        self.logger.log(level, message, *args)
