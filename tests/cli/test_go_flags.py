"""`epp serve` takes the llm-d EPP's command line: Go's flag forms, its flag names, an image whose
ENTRYPOINT gets flags only; what it does not apply it says once, what it cannot take it refuses."""

from __future__ import annotations

import argparse
import logging

import pytest

from epp.cli import build_parser, main, subcommand_parser
from epp.serve_flags import (
    IGNORED_LLMD_FLAGS,
    REFUSED_LLMD_FLAGS,
    FlagError,
    byte_size,
    go_bool,
    go_duration,
    normalize_serve_argv,
    verbosity_count,
)

# Every flag of the llm-d EPP (pkg/epp/server/options.go and its logging options, checked 2026-12-07),
# with the kind of value it takes.
LLMD_FLAGS = {
    "grpc-port": "int", "ha-enable-leader-election": "bool", "drain-timeout": "duration",
    "grpc-max-recv-msg-size": "size", "grpc-max-send-msg-size": "size", "pool-group": "str",
    "pool-namespace": "str", "pool-name": "str", "endpoint-selector": "str", "endpoint-target-ports": "ports",
    "disable-endpoint-subset-filter": "bool", "emit-endpoint-scores": "bool", "refresh-metrics-interval": "duration",
    "refresh-prometheus-metrics-interval": "duration", "metrics-staleness-threshold": "duration",
    "total-queued-requests-metric": "str", "total-running-requests-metric": "str",
    "kv-cache-usage-percentage-metric": "str", "lora-info-metric": "str", "cache-info-metric": "str",
    "v": "int", "zap-devel": "bool", "zap-encoder": "str", "zap-log-level": "str", "zap-stacktrace-level": "str",
    "zap-time-encoding": "str", "tracing": "bool", "health-checking": "bool", "metrics-port": "int",
    "grpc-health-port": "int", "enable-pprof": "bool", "cert-path": "str", "enable-cert-reload": "bool",
    "enable-grpc-stream-metrics": "bool", "secure-serving": "bool", "tls-min-version": "str",
    "tls-cipher-suites": "str", "metrics-endpoint-auth": "bool", "metrics-client-ca-file": "str",
    "metrics-cert-dir": "str", "config-file": "str", "config-text": "str", "allow-experimental-plugins": "bool",
}


def serve_parser() -> argparse.ArgumentParser:
    return subcommand_parser(build_parser(), "serve")


def normalized(*argv: str) -> list[str]:
    return normalize_serve_argv(argv, serve_parser()).argv


def parsed(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *normalized(*argv)])


def test_every_llm_d_flag_is_applied_ignored_or_refused_and_nothing_is_both():
    applied = {o.lstrip("-") for a in serve_parser()._actions for o in a.option_strings}
    for flag in LLMD_FLAGS:
        outcomes = [flag in applied, flag in IGNORED_LLMD_FLAGS, flag in REFUSED_LLMD_FLAGS]
        assert sum(outcomes) == 1, (flag, outcomes)
    assert set(IGNORED_LLMD_FLAGS) | set(REFUSED_LLMD_FLAGS) <= set(LLMD_FLAGS)


@pytest.mark.parametrize("argv", [
    ["--pool-name=R"], ["--pool-name", "R"], ["-pool-name", "R"], ["-pool-name=R"],
])
def test_a_value_flag_takes_go_s_four_spellings(argv):
    assert parsed(*argv).pool_name == "R"


def test_go_takes_the_next_argument_as_the_value_whatever_it_looks_like():
    assert parsed("--config-text", "--not-a-flag").config_text == "--not-a-flag"
    with pytest.raises(FlagError, match="flag needs an argument: --pool-name"):
        normalized("--pool-name")


@pytest.mark.parametrize("argv, value", [
    ([], None), (["--secure-serving"], True), (["-secure-serving"], True), (["--secure-serving=true"], True),
    (["--secure-serving=false"], False), (["--secure-serving=0"], False), (["--secure-serving=T"], True),
    (["--secure-serving=false", "--secure-serving"], True),  # the last one wins, as in Go
])
def test_booleans_as_go_reads_them(argv, value):
    assert parsed(*argv).secure_serving is value


def test_a_bare_boolean_followed_by_false_is_true_and_the_false_is_refused_with_the_spelling_that_works():
    """Go reads `--secure-serving false` as true plus a positional `false`: so does this, and says so."""
    with pytest.raises(FlagError) as err:
        normalized("--secure-serving", "false")
    assert str(err.value) == ("unexpected argument 'false': epp serve takes flags only (a boolean flag takes its "
                              "value after '=': --secure-serving=false)")
    with pytest.raises(FlagError, match=r"--zap-devel=false"):
        normalized("--zap-devel", "false")


def test_a_wrong_boolean_is_refused_naming_the_flag():
    with pytest.raises(FlagError, match="invalid boolean value 'yes' for --tracing"):
        normalized("--tracing=yes")


@pytest.mark.parametrize("text, seconds", [
    ("50ms", 0.05), ("5s", 5.0), ("1m30s", 90.0), ("2h", 7200.0), ("1.5s", 1.5), ("300us", 0.0003),
    ("300\u00b5s", 0.0003), ("0", 0.0), ("0.05", 0.05), ("10", 10.0), ("-1", -1.0), ("-1m30s", -90.0),
])
def test_go_durations_and_plain_seconds(text, seconds):
    assert go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5x", "ms", "1m30", "--5s", "5 s", "1h-5m"])
def test_what_is_no_duration_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a duration"):
        go_duration(text)


def test_duration_flags_take_go_durations_end_to_end():
    args = parsed("--refresh-metrics-interval=50ms", "--drain-timeout", "1m30s", "--metrics-staleness-threshold=2s",
                  "--grace-period=30s")
    assert (args.refresh_metrics_interval, args.drain_timeout, args.metrics_staleness_threshold,
            args.grace_period) == (pytest.approx(0.05), 90.0, 2.0, 30.0)
    assert parsed().refresh_metrics_interval == pytest.approx(0.05) and parsed().drain_timeout == 0.0


@pytest.mark.parametrize("text, size", [
    ("10MiB", 10 * 2 ** 20), ("25MB", 25_000_000), ("64Mi", 64 * 2 ** 20), ("4k", 4000), ("1048576", 2 ** 20),
    ("1.5Ki", 1536),
])
def test_message_sizes_as_llm_d_reads_them(text, size):
    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["ten", "4Zi", "0.5", "2Gi", "-1"])
def test_a_message_size_that_is_no_size_or_too_big_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


def test_go_bool_spellings():
    assert [go_bool(t) for t in ("1", "t", "T", "TRUE", "true", "True")] == [True] * 6
    assert [go_bool(t) for t in ("0", "f", "F", "FALSE", "false", "False")] == [False] * 6
    with pytest.raises(argparse.ArgumentTypeError):
        go_bool("yes")


@pytest.mark.parametrize("argv, count, level", [
    (["-v"], 1, None), (["-vv"], 2, None), (["--verbose"], 1, None), (["-v=2"], 0, 2), (["--v=3"], 1, 3),
    (["-v", "4"], 2, 4), (["-v5"], 2, 5), (["--v", "1"], 0, 1),
])
def test_verbosity_our_count_and_llm_d_s_level(argv, count, level):
    line = normalize_serve_argv(argv, serve_parser())
    assert line.verbosity == level
    assert build_parser().parse_args(["serve", *line.argv]).verbose == count


def test_llm_d_levels_map_default_to_ours_3_to_info_4_and_above_to_debug():
    assert [verbosity_count(n) for n in range(7)] == [0, 0, 0, 1, 2, 2, 2]


def test_an_unknown_flag_is_an_error_naming_it_with_the_closest_known_one():
    with pytest.raises(FlagError, match=r"^unknown flag --pool-nam \(did you mean --pool-name\?\)$"):
        normalized("--pool-nam=R")
    with pytest.raises(FlagError, match=r"^unknown flag -zap-encodr \(did you mean --zap-encoder\?\)$"):
        normalized("-zap-encodr", "json")
    with pytest.raises(FlagError, match=r"^unknown flag --frobnicate$"):
        normalized("--frobnicate")


def test_an_abbreviation_is_no_flag_as_in_go():
    with pytest.raises(FlagError, match="unknown flag --pool-n "):
        normalized("--pool-n", "R")


@pytest.mark.parametrize("flag", sorted(REFUSED_LLMD_FLAGS))
def test_refused_llm_d_flags_say_why(flag):
    with pytest.raises(FlagError) as err:
        normalized(f"--{flag}=x")
    assert str(err.value) == f"--{flag}: {REFUSED_LLMD_FLAGS[flag]}"


def test_ignored_flags_are_checked_as_llm_d_checks_them_and_listed_once_with_why():
    line = normalize_serve_argv(["--enable-pprof=false", "--zap-devel", "--zap-time-encoding", "rfc3339",
                                 "--refresh-prometheus-metrics-interval=5s", "--pool-name", "R"], serve_parser())
    assert line.argv == ["--pool-name=R"]
    assert [flag for flag, _ in line.ignored] == ["--enable-pprof=false", "--zap-devel", "--zap-time-encoding=rfc3339",
                                                  "--refresh-prometheus-metrics-interval=5s"]
    text = line.ignored_line()
    assert text is not None and text.startswith("accepted from the llm-d EPP and ignored: --enable-pprof=false (")
    assert IGNORED_LLMD_FLAGS["zap-time-encoding"].reason in text
    with pytest.raises(FlagError, match="--zap-time-encoding: 'rfc9999': expected one of"):
        normalized("--zap-time-encoding=rfc9999")
    with pytest.raises(FlagError, match="^--refresh-prometheus-metrics-interval: '5x' is not a duration"):
        normalized("--refresh-prometheus-metrics-interval=5x")
    assert normalize_serve_argv(["--pool-name=R"], serve_parser()).ignored_line() is None


def test_emit_endpoint_scores_keeps_our_separate_word_and_takes_llm_d_s_boolean():
    assert parsed("--emit-endpoint-scores", "scorers").emit_endpoint_scores == "scorers"
    assert parsed("--emit-endpoint-scores").emit_endpoint_scores == "totals"
    assert parsed("--emit-endpoint-scores=false").emit_endpoint_scores is None
    assert parsed("-emit-endpoint-scores=true").emit_endpoint_scores == "totals"


def test_help_in_go_s_spellings(capsys):
    for spelling in ("-h", "--help", "-help"):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", spelling])
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--drain-timeout" in out and "--metrics-endpoint-auth" in out
    assert "--enable-pprof" in out and "--tls-cipher-suites" in out  # the epilog lists ignored and refused


def test_a_first_argument_that_is_a_flag_means_serve(capsys):
    """The image's ENTRYPOINT is `epp` and the chart gives flags only: `epp --flag` is `epp serve --flag`."""
    assert main(["--frobnicate"]) == 2
    assert capsys.readouterr().err == "epp serve: unknown flag --frobnicate\n"
    assert main(["--config-file", "/no/such/config.yaml", "--endpoints", "127.0.0.1:1"]) == 2
    assert "/no/such/config.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and "epp (llm-epp)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["-help"])
    assert exit_.value.code == 0 and "A first argument that is a flag means `epp serve`" in capsys.readouterr().out


def test_the_ignored_flags_are_logged_once_before_anything_starts(capsys, caplog):
    caplog.set_level(logging.WARNING, logger="epp.serve")
    assert main(["--enable-pprof=false", "--allow-experimental-plugins", "--config-file", "/no/such.yaml",
                 "--endpoints", "127.0.0.1:1"]) == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "epp.serve"]
    assert len(lines) == 1 and "--enable-pprof=false" in lines[0] and "--allow-experimental-plugins" in lines[0]


@pytest.mark.parametrize("argv, secure, auth", [
    (["--endpoints", "127.0.0.1:1"], False, False),
    (["--pool-name", "R"], True, True),
    (["--endpoint-selector", "app=x", "--endpoint-target-ports", "8000"], True, True),
    (["--pool-name", "R", "--secure-serving=false", "--metrics-endpoint-auth=false"], False, False),
    (["--endpoints", "127.0.0.1:1", "--secure-serving", "--metrics-endpoint-auth=true"], True, True),
])
def test_tls_and_metrics_auth_default_to_llm_d_s_with_kubernetes_discovery_only(argv, secure, auth):
    from epp.cli import _security_options

    args = parsed(*argv)
    options = _security_options(args, kubernetes=bool(args.pool_name or args.endpoint_selector))
    assert (options["secure_serving"], options["metrics_auth"]) == (secure, auth)


@pytest.mark.parametrize("argv, message", [
    (["--tls-min-version=VersionTLS13"], "--tls-min-version=VersionTLS13: not settable here"),
    (["--drain-timeout=-5s"], "--drain-timeout: -5s; it cannot be negative"),
    (["--refresh-metrics-interval=0s"], "--refresh-metrics-interval: 0s; it must be above 0"),
    (["--metrics-staleness-threshold=0"], "--metrics-staleness-threshold: 0s; it must be above 0"),
    (["--metrics-client-ca-file=/x"], "--metrics-client-ca-file needs --metrics-cert-dir"),
    (["--metrics-cert-dir=/no/such/dir"], "--metrics-cert-dir /no/such/dir: no tls.crt there"),
    (["--cert-path=/no/such/dir"], "--cert-path /no/such/dir: no tls.crt there"),
    (["--pool-name", "R", "--endpoints", "127.0.0.1:1"], "Kubernetes discovery excludes --endpoints"),
    (["--ha-enable-leader-election", "--endpoints", "127.0.0.1:1"],
     "--ha-enable-leader-election needs --pool-name or --endpoint-selector"),
])
def test_flag_combinations_llm_d_refuses_are_one_line(capsys, argv, message):
    assert main(["serve", *argv]) == 2
    assert capsys.readouterr().err.startswith(f"epp serve: {message}")


def test_metrics_tls_without_any_authentication_is_refused_as_llm_d_does(capsys, tmp_path):
    from epp.server.tls import self_signed_pair

    key, cert = self_signed_pair()
    (tmp_path / "tls.key").write_bytes(key)
    (tmp_path / "tls.crt").write_bytes(cert)
    assert main(["serve", "--endpoints", "127.0.0.1:1", f"--metrics-cert-dir={tmp_path}"]) == 2
    assert "serves /metrics over TLS without authentication" in capsys.readouterr().err


def test_standalone_leader_election_names_the_deployment_s_lease_from_pod_name(monkeypatch, capsys):
    from epp.cli import _kubernetes_options

    argv = ["--endpoint-selector=app=vllm", "--endpoint-target-ports=8000", "--ha-enable-leader-election"]
    monkeypatch.setenv("NAMESPACE", "llm")
    monkeypatch.setenv("POD_NAME", "router-epp-5d9c7b8f4-x2x9k")
    options = _kubernetes_options(parsed(*argv))
    assert options["ha_lease_name"] == "epp-llm-router-epp.gateway-api-inference-extension.sigs.k8s.io"
    monkeypatch.delenv("POD_NAME")
    assert main(["serve", *argv]) == 2
    assert "needs $POD_NAME" in capsys.readouterr().err
    monkeypatch.setenv("POD_NAME", "no_shape")
    assert main(["serve", *argv]) == 2
    assert "is not a Deployment's pod name" in capsys.readouterr().err
