"""`epp serve`'s command line in Go's flag syntax, and what it does with each flag of the llm-d EPP.

The llm-d router's Helm chart starts the EPP image with `args` written for a Go program (pflag):
`--flag=value`, `--flag value`, `-flag value`, booleans set false only as `--flag=false` (a bare
`--flag false` sets the flag and leaves `false` as a positional argument), `-v=N`, Go durations
(`50ms`, `1m30s`). `normalize_serve_argv` rewrites such a line into the canonical `--flag=value`
form argparse reads, so the same parser (and `--help`, and the flag tables in the docs) serves both
our own spellings and Go's. Each llm-d flag is one of:

- applied: a flag of `epp serve` with the same name (`--pool-name`, `--drain-timeout`, ...);
- accepted and ignored (`IGNORED_LLMD_FLAGS`): its value is checked as llm-d would, then logged
  once with why it has no effect here;
- refused (`REFUSED_LLMD_FLAGS`): one line saying why and what to do instead.

Anything else is an unknown flag: an error naming it, with the closest known name.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from epp.framework.durations import unit_duration

# Go's strconv.ParseBool, which pflag's boolean flags use.
_GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_GO_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})

_PLAIN_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")

# Kubernetes quantity suffixes (resource.ParseQuantity), which llm-d's message-size flags take.
_BINARY = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}
_DECIMAL = {"k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18}
_QUANTITY = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")

# llm-d's verbosity levels (`-v=N`): 2 is its default, 3 verbose, 4 debug, 5 trace.
LLMD_VERBOSE, LLMD_DEBUG = 3, 4


class FlagError(ValueError):
    """A command line `epp serve` cannot take; the message is the one line the user sees."""


def go_bool(text: str) -> bool:
    """A boolean as Go's flag packages read it (`true`, `false`, `1`, `0`, `t`, `F`, ...)."""
    if text in _GO_TRUE:
        return True
    if text in _GO_FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


def go_duration(text: str) -> float:
    """Seconds of a Go duration (`50ms`, `1m30s`, `-2h`, `0`); a plain number is seconds, as our flags always
    took. A sign is read as Go reads it; which flags may be negative is for their own checks to say."""
    value = text.strip()
    sign = -1.0 if value.startswith("-") else 1.0
    value = value[1:] if value[:1] in "+-" else value
    if _PLAIN_NUMBER.fullmatch(value):
        return sign * float(value)
    total = unit_duration(value)
    if total is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 50ms, 5s, 1m30s, or seconds)")
    return sign * total


def byte_size(text: str) -> int:
    """Bytes of a size as llm-d's `--grpc-max-*-msg-size` reads it: `10MiB`, `25MB`, `64Mi`, `1048576`."""
    value = text.strip()
    if len(value) > 1 and value[-1] in "Bb":  # llm-d drops one trailing B before parsing the quantity
        value = value[:-1]
    match = _QUANTITY.fullmatch(value)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4Mi, 16MiB, 25MB or bytes)")
    number, suffix = match.groups()
    size = float(number) * (_BINARY.get(suffix or "") or _DECIMAL.get(suffix or "", 1))
    if size != int(size):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    if size >= 2 ** 31:  # gRPC keeps message sizes in a signed 32-bit int
        raise argparse.ArgumentTypeError(f"{text!r} is over gRPC's largest message size (2 GiB - 1)")
    return int(size)


def _choice(*allowed: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"{text!r}: expected one of {', '.join(allowed)}")
        return text
    return check


def zap_level(text: str) -> str:
    """`--zap-log-level`: debug, info, error, panic, or an integer above 0 (more verbose than debug)."""
    if text in ("debug", "info", "error", "panic") or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected debug, info, error, panic or an integer above 0")


def add_bool_flag(group: argparse._ActionsContainer, *names: str, help: str,  # noqa: A002 (argparse's name)
                  default: bool | None = False) -> None:
    """A boolean flag that takes Go's forms: `--name` (true), `--name=true`, `--name=false`."""
    group.add_argument(*names, nargs="?", const=True, default=default, type=go_bool, metavar="true|false",
                       help=help)


@dataclass(frozen=True)
class IgnoredFlag:
    """An llm-d flag `epp serve` accepts, checks and does nothing with: `check` reads its value (None: boolean)."""

    reason: str
    check: Callable[[str], object] | None = None


# Accepted and ignored: what llm-d does with it has no counterpart here, or ours is always on.
IGNORED_LLMD_FLAGS: Mapping[str, IgnoredFlag] = {
    "refresh-prometheus-metrics-interval": IgnoredFlag(
        "the pool gauges on /metrics are computed when /metrics is read", go_duration),
    "enable-pprof": IgnoredFlag("Go's profiler; profile the picker with py-spy, see its state with "
                                "--enable-debug-endpoint"),
    "enable-grpc-stream-metrics": IgnoredFlag(
        "the ext_proc stream metrics (epp_extproc_streams_active, epp_extproc_messages_total, "
        "epp_extproc_stream_errors_total) are always on"),
    "allow-experimental-plugins": IgnoredFlag("the plugin types that are alpha in llm-d load here without it"),
    "zap-devel": IgnoredFlag("zap's development preset; use -v or --zap-log-level"),
    "zap-stacktrace-level": IgnoredFlag("tracebacks are logged at debug level (-vv)", _choice("info", "error",
                                                                                            "panic")),
    "zap-time-encoding": IgnoredFlag("log times are ISO 8601", _choice(
        "epoch", "millis", "nano", "iso8601", "rfc3339", "rfc3339nano")),
}

# Go's crypto/tls names of the TLS 1.2 suites gRPC's BoringSSL offers, and BoringSSL's names for them
# (what GRPC_SSL_CIPHER_SUITES takes).
TLS12_SUITES: Mapping[str, str] = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
}
# TLS 1.3's suites: Go accepts their names and cannot configure them either.
TLS13_SUITES = frozenset({"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"})


def cipher_list(text: str) -> str:
    """`--tls-cipher-suites` (Go's names, comma-separated) as BoringSSL's cipher list for TLS 1.2, which gRPC
    reads from GRPC_SSL_CIPHER_SUITES; TLS 1.3 names are accepted and change nothing (as in Go)."""
    chosen: list[str] = []
    for name in filter(None, (part.strip() for part in text.split(","))):
        if name in TLS13_SUITES:
            continue
        if name not in TLS12_SUITES:
            raise argparse.ArgumentTypeError(
                f"unknown or unsupported cipher suite {name!r} (gRPC's TLS 1.2 suites: {', '.join(TLS12_SUITES)})")
        if TLS12_SUITES[name] not in chosen:
            chosen.append(TLS12_SUITES[name])
    if not chosen:
        raise argparse.ArgumentTypeError(f"{text!r} names no TLS 1.2 suite (TLS 1.3's are not configurable)")
    return ":".join(chosen)


_ENGINE_CONFIGS = ("deprecated in llm-d, which refuses it too: name the model server's metrics with "
                   "core-metrics-extractor's engineConfigs in the EndpointPickerConfig")
# Refused, with why: llm-d refuses these itself.
REFUSED_LLMD_FLAGS: Mapping[str, str] = {
    "total-queued-requests-metric": _ENGINE_CONFIGS,
    "total-running-requests-metric": _ENGINE_CONFIGS,
    "kv-cache-usage-percentage-metric": _ENGINE_CONFIGS,
    "lora-info-metric": _ENGINE_CONFIGS,
    "cache-info-metric": _ENGINE_CONFIGS,
}


@dataclass
class ServeArgv:
    """A command line rewritten for argparse, and the llm-d flags it named that have no effect here."""

    argv: list[str]
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (flag as given, why it has no effect)
    verbosity: int | None = None  # llm-d's `-v=N`, when given

    def ignored_line(self) -> str | None:
        """The one log line that lists the ignored flags, or None when there is none."""
        if not self.ignored:
            return None
        return "accepted from the llm-d EPP and ignored: " + "; ".join(f"{flag} ({why})" for flag, why in self.ignored)


def verbosity_count(level: int) -> int:
    """Our `-v` count for llm-d's `-v=N`: its default (2) and below are ours, 3 is info, 4 and above debug."""
    if level >= LLMD_DEBUG:
        return 2
    return 1 if level >= LLMD_VERBOSE else 0


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's actions by flag name without its dashes (`-v` and `--verbose` both)."""
    return {option.lstrip("-"): action for action in parser._actions for option in action.option_strings}


def _canonical(action: argparse.Action) -> str:
    """The long spelling argparse is handed (`--name`), else the only one."""
    return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])


def _did_you_mean(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean --{close[0]}?)" if close else ""


def _verbosity(name: str, value: str | None, rest: list[str]) -> int | None:
    """llm-d's `-v=N`, `--v=N`, `-vN`, `-v N` as a level; None for our own `-v`/`-vv` counts."""
    if value is not None:
        if not value.isdigit():
            raise FlagError(f"-v={value}: expected a number (llm-d's verbosity, e.g. -v=4)")
        return int(value)
    if name[1:].isdigit():
        return int(name[1:])
    if rest and rest[0].isdigit():  # pflag's -v takes a value; ours alone is a count
        return int(rest.pop(0))
    return None


def normalize_serve_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> ServeArgv:
    """Rewrite an `epp serve` line in Go's or our syntax as canonical `--flag=value` arguments of `parser`.

    FlagError names the first flag that is unknown, refused, lacks its value or has a wrong boolean
    or (for an ignored flag) a wrong value; a positional argument is refused too (`epp serve` takes
    none: it is most often the `false` of a bare `--flag false`, which Go does not read as false).
    """
    options = _options(parser)
    known = sorted({*options, *IGNORED_LLMD_FLAGS, *REFUSED_LLMD_FLAGS} - {"h"})
    out = ServeArgv([])
    rest = list(argv)
    previous: str | None = None
    while rest:
        arg = rest.pop(0)
        if arg == "--":
            if rest:
                raise FlagError(f"unexpected argument {rest[0]!r}: epp serve takes flags only")
            break
        if not arg.startswith("-") or arg == "-":
            hint = ""
            if previous is not None and arg in _GO_TRUE | _GO_FALSE:
                hint = f" (a boolean flag takes its value after '=': {previous}={arg})"
            raise FlagError(f"unexpected argument {arg!r}: epp serve takes flags only{hint}")
        body = arg[2:] if arg.startswith("--") else arg[1:]
        name, eq, value_text = body.partition("=")
        value = value_text if eq else None
        previous = None
        if re.fullmatch(r"v\d*", name) and (name != "v" or value is not None or (rest and rest[0].isdigit())):
            level = _verbosity(name, value, rest)
            if level is not None:
                out.verbosity = level
                out.argv.extend(["--verbose"] * verbosity_count(level))
                continue
        if re.fullmatch(r"v+", name) and not arg.startswith("--") and value is None:
            out.argv.append(arg)  # our own -v / -vv count
            continue
        action = options.get(name)
        if action is None:
            previous = _other_llmd_flag(arg, name, value, rest, out, known)
            continue
        flag = _canonical(action)
        if isinstance(action, argparse._HelpAction):
            out.argv.append(flag)
        elif isinstance(action, argparse._CountAction):
            if value is not None:
                raise FlagError(f"{arg}: {flag} is a count (repeat it, or give llm-d's -v=N)")
            out.argv.append(flag)
        elif action.type is go_bool:
            if value is None:
                previous, value = f"--{name}", "true"
            elif value not in _GO_TRUE | _GO_FALSE:
                raise FlagError(f"invalid boolean value {value!r} for {flag}: expected true or false")
            out.argv.append(f"{flag}={value}")
        elif action.nargs == "?":
            # An optional value (--emit-endpoint-scores): our own words may follow, separated.
            words = action.metavar.split("|") if isinstance(action.metavar, str) else []
            if value is None and rest and rest[0] in words:
                value = rest.pop(0)
            out.argv.append(flag if value is None else f"{flag}={value}")
        else:
            if value is None:
                if not rest:
                    raise FlagError(f"flag needs an argument: {flag}")
                value = rest.pop(0)  # Go takes the next argument whatever it looks like
            out.argv.append(f"{flag}={value}")
    return out


def _other_llmd_flag(arg: str, name: str, value: str | None, rest: list[str], out: ServeArgv,
                     known: Sequence[str]) -> str | None:
    """An llm-d flag `epp serve` has no option for: accepted and ignored (recorded), or FlagError.
    Returns the flag when it was a boolean given without a value (a stray `false` after it gets a hint)."""
    if name in REFUSED_LLMD_FLAGS:
        raise FlagError(f"--{name}: {REFUSED_LLMD_FLAGS[name]}")
    ignored = IGNORED_LLMD_FLAGS.get(name)
    if ignored is None:
        raise FlagError(f"unknown flag {arg.split('=', 1)[0]}{_did_you_mean(name, known)}")
    if ignored.check is None:
        if value is not None and value not in _GO_TRUE | _GO_FALSE:
            raise FlagError(f"invalid boolean value {value!r} for --{name}: expected true or false")
        shown = f"--{name}" if value is None else f"--{name}={value}"
        bare = f"--{name}" if value is None else None
    else:
        if value is None:
            if not rest:
                raise FlagError(f"flag needs an argument: --{name}")
            value = rest.pop(0)
        try:
            ignored.check(value)
        except argparse.ArgumentTypeError as exc:
            raise FlagError(f"--{name}: {exc}") from None
        shown, bare = f"--{name}={value}", None
    out.ignored.append((shown, ignored.reason))
    return bare
